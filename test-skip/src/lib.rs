//! `pegaflow-test-skip`: how a test that cannot run here says so, so that it is counted as
//! skipped rather than passed.
//!
//! Stable Rust has no way for a running test to mark itself ignored, and cargo hides what a
//! passing test prints. [`skip!`] writes one line, past cargo's output capture, straight to
//! the process's standard error:
//!
//! ```text
//! SKIPPED: ssd::a_full_filesystem: needs root to mount a 56 MiB tmpfs
//! ```
//!
//! (`ssd` is the test binary, `tiers/ssd/tests/ssd.rs`; a crate's unit tests are named after
//! the crate.)
//!
//! `scripts/test.sh` collects these lines, lists them at the end and counts them as skipped
//! in its totals line, subtracted from cargo's passed count. [`skip_part!`] is for a test
//! that runs but leaves one part out (`SKIPPED PART: ...`): listed, and counted apart, but the
//! test still passed what it ran.
//!
//! A crate of its own with no dependencies, so that every crate of the workspace (the
//! runtime's unit tests included) can take it as a dev-dependency without a cycle; nothing
//! of it reaches a shipped binary. Must never: print through `print!`/`eprint!` (cargo
//! would capture the line and the skip would pass unseen).

use std::io::Write;

/// The start of a whole test's skip line, which `scripts/test.sh` counts.
pub const SKIPPED: &str = "SKIPPED:";
/// The start of a skipped part's line.
pub const SKIPPED_PART: &str = "SKIPPED PART:";

/// Marks the calling test skipped for the reason given (`format!` arguments); the test
/// returns right after.
///
/// ```no_run
/// fn needs_root() {
///     if !is_root() {
///         pegaflow_test_skip::skip!("needs root to create network namespaces");
///         return;
///     }
///     // ...
/// }
/// # fn is_root() -> bool { false }
/// # needs_root();
/// ```
#[macro_export]
macro_rules! skip {
    ($($reason:tt)+) => {
        $crate::record($crate::SKIPPED, module_path!(), &format!($($reason)+))
    };
}

/// Marks a part of the calling test skipped for the reason given (`format!` arguments); the
/// test goes on with the rest.
#[macro_export]
macro_rules! skip_part {
    ($($reason:tt)+) => {
        $crate::record($crate::SKIPPED_PART, module_path!(), &format!($($reason)+))
    };
}

/// Writes [`line`] for the calling thread to standard error in one write, past the test
/// harness's capture.
pub fn record(mark: &str, module: &str, reason: &str) {
    let exe = std::env::current_exe().ok();
    let binary = exe.as_deref().and_then(test_binary);
    let text = line(
        mark,
        binary.unwrap_or(module),
        std::thread::current().name(),
        reason,
    );
    let _ = std::io::stderr().lock().write_all(text.as_bytes());
}

/// The test binary's name: its file name without cargo's `-<16 hex digits>` suffix
/// (`conformance-0123456789abcdef` is the `conformance` test of its crate; a crate's unit
/// tests are named after the crate). `None` for another file name.
pub fn test_binary(exe: &std::path::Path) -> Option<&str> {
    let name = exe.file_name()?.to_str()?;
    let (stem, hash) = name.rsplit_once('-')?;
    (hash.len() == 16 && hash.bytes().all(|b| b.is_ascii_hexdigit())).then_some(stem)
}

/// `mark binary::test: reason` and a newline: `binary` is the test binary (or, where it is
/// not known, the caller's module path, of which the first segment is kept), the test its
/// thread's name (the harness names each test's thread after the test), or the module where
/// the thread has none; a multi-line reason is put on one line.
pub fn line(mark: &str, binary: &str, thread: Option<&str>, reason: &str) -> String {
    let krate = binary.split("::").next().unwrap_or(binary);
    let test = match thread {
        Some(name) if name != "main" => name,
        _ => binary,
    };
    format!("{mark} {krate}::{test}: {}\n", reason.replace('\n', " "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_line_names_the_crate_the_test_and_the_reason() {
        // What `record` sees when called from this test.
        let exe = std::env::current_exe().unwrap();
        assert_eq!(test_binary(&exe), Some("pegaflow_test_skip"), "{exe:?}");
        let here = line(
            SKIPPED,
            test_binary(&exe).unwrap(),
            std::thread::current().name(),
            "no redis-server\non PATH",
        );
        assert_eq!(
            here,
            "SKIPPED: pegaflow_test_skip::tests::the_line_names_the_crate_the_test_and_the_reason: no redis-server on PATH\n"
        );
        let p = std::path::Path::new("/t/debug/deps/conformance-0123456789abcdef");
        assert_eq!(test_binary(p), Some("conformance"));
        assert_eq!(
            test_binary(std::path::Path::new("/usr/bin/pegaflow-server")),
            None
        );
        assert_eq!(
            line(SKIPPED_PART, "ssd::support", None, "x"),
            "SKIPPED PART: ssd::ssd::support: x\n"
        );
        assert_eq!(
            line(SKIPPED, "dram", Some("main"), "y"),
            "SKIPPED: dram::dram: y\n"
        );
    }
}
