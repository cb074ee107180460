//! Units of the pipeline's settings: byte sizes written as PegaFlow's flags write them
//! (`30gb`, binary units), with the serde helpers a backend's config struct uses for them.
//!
//! Must never: read a size two ways (every size setting and size flag goes through
//! [`parse_size`]), or write one that [`parse_size`] would read back as another figure.

use anyhow::{bail, Context};

/// Parses a byte size: a plain integer (bytes), or a number with a unit. `kb`/`mb`/`gb`/`tb`
/// (PegaFlow's `--pool-size` units) and `k`/`m`/`g`/`t`, `kib`/`mib`/`gib`/`tib` are binary
/// (powers of 1024); case and a space before the unit are ignored. Fractions are allowed
/// (`1.5gb`).
pub fn parse_size(s: &str) -> anyhow::Result<u64> {
    let t = s.trim().to_ascii_lowercase();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let unit = unit.trim();
    let mult: u64 = match unit {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        _ => bail!("invalid size {s:?}: unknown unit {unit:?} (use kb, mb, gb or tb)"),
    };
    if num.is_empty() {
        bail!("invalid size {s:?}: no number");
    }
    let v: f64 = num.parse().with_context(|| format!("invalid size {s:?}"))?;
    let bytes = v * mult as f64;
    if !bytes.is_finite() || bytes < 0.0 || bytes > u64::MAX as f64 {
        bail!("invalid size {s:?}: out of range");
    }
    Ok(bytes as u64)
}

/// Serde helpers for size settings of a backend's config struct:
/// `#[serde(with = "pegaflow_plugin::units::size")]` on a `u64` or `usize` field accepts a
/// size string (`"30gb"`, as [`parse_size`] reads it) or a byte count, and writes a whole
/// number of kb, mb, gb or tb as such a string (`"30gb"`), any other size as bytes.
pub mod size {
    use serde::de::{self, Visitor};
    use serde::{Deserializer, Serializer};

    const UNITS: [(u64, &str); 4] = [
        (1 << 40, "tb"),
        (1 << 30, "gb"),
        (1 << 20, "mb"),
        (1 << 10, "kb"),
    ];

    /// `bytes` as its shortest exact unit string (`"30gb"`), or `None` when no unit divides it.
    fn with_unit(bytes: u64) -> Option<String> {
        UNITS
            .iter()
            .find(|(u, _)| bytes > 0 && bytes.is_multiple_of(*u))
            .map(|(u, name)| format!("{}{name}", bytes / u))
    }

    /// `bytes` as a pipeline value: a unit string when a unit divides it, else an integer
    /// (a string of digits beyond `i64::MAX`).
    pub fn to_value(bytes: u64) -> toml::Value {
        match (with_unit(bytes), i64::try_from(bytes)) {
            (Some(s), _) => toml::Value::String(s),
            (None, Ok(i)) => toml::Value::Integer(i),
            (None, Err(_)) => toml::Value::String(bytes.to_string()),
        }
    }

    /// Writes a size as [`to_value`] does.
    ///
    /// # Errors
    /// The serializer's own errors, or a value that does not fit `u64`.
    pub fn serialize<S: Serializer, T: Copy + TryInto<u64>>(
        v: &T,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        let bytes: u64 = (*v)
            .try_into()
            .map_err(|_| serde::ser::Error::custom("size does not fit 64 bits"))?;
        match to_value(bytes) {
            toml::Value::Integer(i) => s.serialize_i64(i),
            other => s.serialize_str(other.as_str().unwrap_or_default()),
        }
    }

    /// Reads a size string or a byte count.
    ///
    /// # Errors
    /// Another type, a negative count, a string [`super::parse_size`] refuses, or a size
    /// that does not fit `T`.
    pub fn deserialize<'de, D: Deserializer<'de>, T: TryFrom<u64>>(d: D) -> Result<T, D::Error> {
        struct Size;
        impl Visitor<'_> for Size {
            type Value = u64;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a size like \"30gb\" or a byte count")
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<u64, E> {
                u64::try_from(v).map_err(|_| E::custom(format!("invalid size {v}: negative")))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<u64, E> {
                Ok(v)
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<u64, E> {
                super::parse_size(v).map_err(E::custom)
            }
        }
        let bytes = d.deserialize_any(Size)?;
        T::try_from(bytes).map_err(|_| de::Error::custom(format!("size {bytes} is too large")))
    }
}
