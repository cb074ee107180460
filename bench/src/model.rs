//! Block geometry from a real model's KV layout, optionally scaled down to fit a small
//! machine.
//!
//! A 512-token block of Llama-3.1-8B in bf16 holds 32 layers × 2 (K, V) × 8 KV heads × 128
//! head dim × 2 bytes × 512 tokens = 64 MiB. The replay keeps the model's layer count and
//! per-token segment width, and stores `512 / scale` tokens' worth of KV per block, so every
//! byte count is the real one divided by `scale`.

use std::fmt;

use crate::trace::TRACE_BLOCK_TOKENS;

/// A model's KV geometry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelPreset {
    /// Name used on the command line.
    pub name: &'static str,
    /// Attention layers (one registered KV tensor each).
    pub layers: u32,
    /// KV heads per layer.
    pub kv_heads: u32,
    /// Head dimension.
    pub head_dim: u32,
    /// Bytes per element (2 for bf16).
    pub dtype_bytes: u32,
}

/// The models the replay knows, by name.
pub const PRESETS: &[ModelPreset] = &[
    ModelPreset {
        name: "llama-3.1-8b",
        layers: 32,
        kv_heads: 8,
        head_dim: 128,
        dtype_bytes: 2,
    },
    ModelPreset {
        name: "llama-3.1-70b",
        layers: 80,
        kv_heads: 8,
        head_dim: 128,
        dtype_bytes: 2,
    },
    ModelPreset {
        name: "qwen2.5-7b",
        layers: 28,
        kv_heads: 4,
        head_dim: 128,
        dtype_bytes: 2,
    },
];

impl ModelPreset {
    /// Looks a preset up by name (case-insensitive).
    pub fn find(name: &str) -> Option<ModelPreset> {
        PRESETS
            .iter()
            .find(|p| p.name.eq_ignore_ascii_case(name))
            .copied()
    }

    /// Bytes of K (or V) of one token in one layer.
    pub fn token_segment_bytes(&self) -> u64 {
        self.kv_heads as u64 * self.head_dim as u64 * self.dtype_bytes as u64
    }
}

/// The block geometry the replay registers: `layers` KV-first tensors
/// `[2, num_blocks, segment_bytes]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockGeometry {
    /// The model the geometry comes from.
    pub model: ModelPreset,
    /// The divisor applied to a 512-token block (1 = the real size).
    pub scale: u32,
}

impl BlockGeometry {
    /// The geometry of `model` scaled by `scale`, which must divide 512.
    pub fn new(model: ModelPreset, scale: u32) -> anyhow::Result<Self> {
        if scale == 0 || !TRACE_BLOCK_TOKENS.is_multiple_of(scale as u64) {
            anyhow::bail!(
                "--scale must divide {TRACE_BLOCK_TOKENS} (1, 2, 4, ..., 512), got {scale}"
            );
        }
        Ok(Self { model, scale })
    }

    /// Layers.
    pub fn layers(&self) -> usize {
        self.model.layers as usize
    }

    /// Tokens' worth of KV stored per block.
    pub fn stored_tokens(&self) -> u64 {
        TRACE_BLOCK_TOKENS / self.scale as u64
    }

    /// Bytes of one segment (K or V) of one block in one layer.
    pub fn segment_bytes(&self) -> usize {
        (self.model.token_segment_bytes() * self.stored_tokens()) as usize
    }

    /// Bytes of one block: all layers, both segments.
    pub fn block_bytes(&self) -> u64 {
        self.segment_bytes() as u64 * 2 * self.model.layers as u64
    }

    /// Bytes of one unscaled 512-token block of the model.
    pub fn real_block_bytes(&self) -> u64 {
        self.block_bytes() * self.scale as u64
    }
}

impl fmt::Display for BlockGeometry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} bf16: {} layers x 2 (K,V) x {} KV heads x {} head dim x {} B; 512-token block = {} real, scaled 1/{} ({} tokens stored) = {} per block ({} per segment)",
            self.model.name,
            self.model.layers,
            self.model.kv_heads,
            self.model.head_dim,
            self.model.dtype_bytes,
            human_bytes(self.real_block_bytes()),
            self.scale,
            self.stored_tokens(),
            human_bytes(self.block_bytes()),
            human_bytes(self.segment_bytes() as u64),
        )
    }
}

/// `n` bytes in binary units (`512 KiB`, `1.50 GiB`).
pub fn human_bytes(n: u64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < U.len() {
        v /= 1024.0;
        i += 1;
    }
    if v.fract() == 0.0 {
        format!("{v:.0} {}", U[i])
    } else {
        format!("{v:.2} {}", U[i])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama_8b_block_is_64_mib_and_scales() {
        let m = ModelPreset::find("Llama-3.1-8B").unwrap();
        let g = BlockGeometry::new(m, 1).unwrap();
        assert_eq!(g.block_bytes(), 64 << 20);
        let g = BlockGeometry::new(m, 128).unwrap();
        assert_eq!(g.block_bytes(), 512 << 10);
        assert_eq!(g.segment_bytes(), 8 << 10);
        assert_eq!(g.real_block_bytes(), 64 << 20);
        assert!(BlockGeometry::new(m, 3).is_err());
        assert!(BlockGeometry::new(m, 0).is_err());
        assert_eq!(human_bytes(512 << 10), "512 KiB");
        assert_eq!(human_bytes(3 << 29), "1.50 GiB");
    }
}
