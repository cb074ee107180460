//! The process's one CUDA driver loader (cargo feature `cuda`): loads libcuda at run time
//! (cudarc, `dynamic-loading`), checks that it exports the symbols a caller is about to use,
//! and initialises it with `cuInit(0)`, each once per process.
//!
//! Owns: the load-once and init-once decisions and the "CUDA driver not available: ..."
//! error ([`DriverUnavailable`]). Every crate that calls cudarc's driver API (this crate's
//! [`crate::vmm`], `pegaflow-transport-cuda`) goes through [`init`] first, so the process
//! loads and initialises the driver in one place, whichever caller comes first.
//!
//! Must never: call a cudarc driver function before the library loaded and the symbol
//! resolved (cudarc's loader panics on a missing library or symbol), or let a panic inside
//! cudarc escape: every failure is a [`DriverUnavailable`].

use std::ffi::c_void;
use std::sync::OnceLock;

use cudarc::driver::sys;

/// The CUDA driver cannot be used here: libcuda is missing, lacks a symbol, or `cuInit`
/// failed. Displays as "CUDA driver not available: {why}".
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("CUDA driver not available: {0}")]
pub struct DriverUnavailable(String);

impl DriverUnavailable {
    /// The error for `why` (which the message shows after "CUDA driver not available: ").
    pub fn new(why: impl std::fmt::Display) -> Self {
        Self(why.to_string())
    }
}

/// Whether libcuda loaded (decided on first use, then cached).
static LIBRARY: OnceLock<Result<(), DriverUnavailable>> = OnceLock::new();

/// The answer of the one `cuInit(0)` call of this process.
static INIT: OnceLock<Result<(), DriverUnavailable>> = OnceLock::new();

fn load_library() -> Result<(), DriverUnavailable> {
    // SAFETY: is_culib_present only tries dlopen on candidate names and closes them again.
    let present = std::panic::catch_unwind(|| unsafe { sys::is_culib_present() }).unwrap_or(false);
    if !present {
        return Err(DriverUnavailable::new(
            "libcuda.so.1 could not be loaded (no NVIDIA driver on this machine, or not on the \
             library path)",
        ));
    }
    std::panic::catch_unwind(|| {
        // SAFETY: culib() loads the library found present above.
        let _ = unsafe { sys::culib() };
    })
    .map_err(|_| DriverUnavailable::new("loading libcuda panicked"))
}

/// The names in `symbols` that libcuda does not export, in the given order (empty when it
/// exports them all). Loads libcuda on first use; resolving a name calls nothing.
///
/// Errors: [`DriverUnavailable`] when libcuda cannot be loaded ("libcuda.so.1 could not be
/// loaded ...", or "loading libcuda panicked").
pub fn missing_symbols(symbols: &[&'static str]) -> Result<Vec<&'static str>, DriverUnavailable> {
    LIBRARY.get_or_init(load_library).clone()?;
    std::panic::catch_unwind(|| {
        // SAFETY: the library loaded above (culib() returns the cached handle); get() only
        // resolves names.
        let lib = unsafe { sys::culib() };
        symbols
            .iter()
            .filter(|name| {
                // SAFETY: resolving a symbol has no side effect; the pointer is never called.
                unsafe { lib.get::<*const c_void>(name.as_bytes()) }.is_err()
            })
            .copied()
            .collect()
    })
    .map_err(|_| DriverUnavailable::new("loading libcuda panicked"))
}

/// Makes the driver usable for a caller that will call `symbols`: loads libcuda, checks that
/// it exports `cuInit` and every name in `symbols`, then runs `cuInit(0)` (once per process;
/// later calls return its cached answer). `too_old` is the hint shown after the missing
/// names, e.g. "driver too old for CUDA VMM?".
///
/// Errors: [`DriverUnavailable`] when libcuda cannot be loaded, "libcuda lacks a, b
/// ({too_old})" when symbols are missing, or "cuInit failed: CUDA_ERROR_..." (e.g. no device)
/// or "cuInit panicked".
pub fn init(symbols: &[&'static str], too_old: &str) -> Result<(), DriverUnavailable> {
    let mut missing = missing_symbols(&["cuInit"])?;
    missing.extend(missing_symbols(symbols)?);
    if !missing.is_empty() {
        return Err(DriverUnavailable::new(format!(
            "libcuda lacks {} ({too_old})",
            missing.join(", ")
        )));
    }
    INIT.get_or_init(|| {
        std::panic::catch_unwind(|| {
            // SAFETY: cuInit resolved above; cuInit(0) is the documented first call.
            let r = unsafe { sys::cuInit(0) };
            if r == sys::CUresult::CUDA_SUCCESS {
                Ok(())
            } else {
                Err(DriverUnavailable::new(format!("cuInit failed: {r:?}")))
            }
        })
        .unwrap_or_else(|_| Err(DriverUnavailable::new("cuInit panicked")))
    })
    .clone()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_message_names_the_driver() {
        let e = DriverUnavailable::new("why");
        assert_eq!(e.to_string(), "CUDA driver not available: why");
    }

    #[test]
    fn without_a_driver_every_entry_point_fails_cleanly() {
        // Stable and panic-free either way; on a machine without libcuda it is the clear error.
        let a = init(&["cuDeviceGetCount"], "too old?");
        assert_eq!(a, init(&["cuDeviceGetCount"], "too old?"));
        match missing_symbols(&["cuDeviceGetCount", "cuNoSuchSymbol"]) {
            Ok(missing) => assert_eq!(missing, vec!["cuNoSuchSymbol"]),
            Err(e) => {
                assert!(e.to_string().starts_with("CUDA driver not available:"));
                assert_eq!(a, Err(e));
            }
        }
        if let Ok(missing) = missing_symbols(&["cuNoSuchSymbol"]) {
            let e = init(&["cuNoSuchSymbol"], "too old?").unwrap_err();
            assert_eq!(
                e.to_string(),
                "CUDA driver not available: libcuda lacks cuNoSuchSymbol (too old?)"
            );
            assert_eq!(missing, vec!["cuNoSuchSymbol"]);
        }
    }
}
