//! The Mooncake trace: one JSON object per line, `{timestamp, input_length, output_length,
//! hash_ids}`, one hash id per 512-token block of the prompt (the last block may be partial).

use std::path::{Path, PathBuf};

use anyhow::Context;
use serde::Deserialize;

/// Tokens one trace block covers (the Mooncake release's block size).
pub const TRACE_BLOCK_TOKENS: u64 = 512;

/// File name of the shipped trace.
pub const TRACE_FILE: &str = "mooncake_conversation_trace.jsonl";

/// One request of the trace.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct TraceRequest {
    /// Arrival time in milliseconds from the start of the trace.
    pub timestamp: u64,
    /// Prompt length in tokens.
    pub input_length: u64,
    /// Generated tokens.
    #[serde(default)]
    pub output_length: u64,
    /// Prefix block hashes, one per 512-token block of the prompt.
    pub hash_ids: Vec<u64>,
}

impl TraceRequest {
    /// Tokens covered by block `i` of this request: 512, except the last block, which covers
    /// what is left of the prompt (at least 1 token).
    pub fn block_tokens(&self, i: usize) -> u64 {
        let n = self.hash_ids.len();
        if i + 1 < n {
            TRACE_BLOCK_TOKENS
        } else {
            let before = TRACE_BLOCK_TOKENS * (n.saturating_sub(1)) as u64;
            self.input_length
                .saturating_sub(before)
                .clamp(1, TRACE_BLOCK_TOKENS)
        }
    }

    /// Tokens covered by the first `k` blocks.
    pub fn prefix_tokens(&self, k: usize) -> u64 {
        (0..k.min(self.hash_ids.len()))
            .map(|i| self.block_tokens(i))
            .sum()
    }

    /// Tokens covered by all blocks.
    pub fn total_tokens(&self) -> u64 {
        self.prefix_tokens(self.hash_ids.len())
    }
}

/// Parses a trace from JSONL text, sorted by timestamp (stable: equal timestamps keep their
/// file order). Blank lines are skipped; a malformed line is an error naming its number.
pub fn parse(text: &str) -> anyhow::Result<Vec<TraceRequest>> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let r: TraceRequest = serde_json::from_str(line)
            .with_context(|| format!("trace line {} is not a request object", i + 1))?;
        out.push(r);
    }
    out.sort_by_key(|r| r.timestamp);
    Ok(out)
}

/// Reads and parses the trace at `path`.
pub fn load(path: &Path) -> anyhow::Result<Vec<TraceRequest>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the trace {}", path.display()))?;
    parse(&text).with_context(|| format!("in trace {}", path.display()))
}

/// Where the shipped trace is looked for, in order: the copy in this crate
/// (`bench/data/`), then `../shared/traces/` beside the workspace, then the same two relative
/// to the current directory.
pub fn default_candidates() -> Vec<PathBuf> {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut v = vec![crate_dir.join("data").join(TRACE_FILE)];
    if let Some(ws) = crate_dir.parent() {
        v.push(ws.join("../shared/traces").join(TRACE_FILE));
    }
    v.push(PathBuf::from("bench/data").join(TRACE_FILE));
    v.push(PathBuf::from("../shared/traces").join(TRACE_FILE));
    v
}

/// The first existing default trace path.
pub fn default_path() -> anyhow::Result<PathBuf> {
    let c = default_candidates();
    c.iter().find(|p| p.is_file()).cloned().with_context(|| {
        format!(
            "no trace found (looked at {}); pass --trace PATH",
            c.iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        )
    })
}

/// Summary figures of a trace.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TraceStats {
    /// Requests.
    pub requests: u64,
    /// Blocks over all requests.
    pub blocks: u64,
    /// Distinct hash ids.
    pub unique_blocks: u64,
    /// Prompt tokens over all requests.
    pub tokens: u64,
    /// Most blocks in one request.
    pub max_request_blocks: u64,
    /// Blocks an infinite cache would hit (prefix hits against everything seen before).
    pub infinite_hit_blocks: u64,
    /// Tokens an infinite cache would hit.
    pub infinite_hit_tokens: u64,
}

/// Computes [`TraceStats`].
pub fn stats(reqs: &[TraceRequest]) -> TraceStats {
    let mut seen = std::collections::HashSet::new();
    let mut s = TraceStats {
        requests: reqs.len() as u64,
        ..TraceStats::default()
    };
    for r in reqs {
        s.blocks += r.hash_ids.len() as u64;
        s.tokens += r.total_tokens();
        s.max_request_blocks = s.max_request_blocks.max(r.hash_ids.len() as u64);
        let k = r.hash_ids.iter().take_while(|h| seen.contains(*h)).count();
        s.infinite_hit_blocks += k as u64;
        s.infinite_hit_tokens += r.prefix_tokens(k);
        seen.extend(r.hash_ids.iter().copied());
    }
    s.unique_blocks = seen.len() as u64;
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_sorts_and_counts_tokens() {
        let t = "{\"timestamp\": 5, \"input_length\": 1000, \"output_length\": 3, \"hash_ids\": [0, 1]}\n\
                 \n\
                 {\"timestamp\": 1, \"input_length\": 512, \"output_length\": 1, \"hash_ids\": [0]}\n";
        let r = parse(t).unwrap();
        assert_eq!(r[0].timestamp, 1);
        assert_eq!(r[1].block_tokens(0), 512);
        assert_eq!(r[1].block_tokens(1), 488);
        assert_eq!(r[1].total_tokens(), 1000);
        let s = stats(&r);
        assert_eq!(s.blocks, 3);
        assert_eq!(s.unique_blocks, 2);
        assert_eq!(s.infinite_hit_blocks, 1);
        assert_eq!(s.infinite_hit_tokens, 512);
        assert!(parse("{\"timestamp\": 1}").is_err());
    }

    #[test]
    fn shipped_trace_is_found_and_whole() {
        let p = default_path().unwrap();
        let r = load(&p).unwrap();
        assert_eq!(r.len(), 12_031);
        let s = stats(&r);
        assert_eq!(s.blocks, 288_500);
        assert_eq!(s.unique_blocks, 182_790);
    }
}
