//! `pegaflow-test-skip`: how a test that cannot run here says so, so that it is counted as
//! skipped rather than passed.
//!
//! Stable Rust has no way for a running test to mark itself ignored, and cargo hides what a
//! passing test prints. [`skip!`] writes one line, past cargo's output capture, straight to
//! the process's standard error:
//!
//! ```text
//! SKIPPED: pegaflow_tier_ssd::a_full_filesystem: needs root to mount a 56 MiB tmpfs
//! ```
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
    let text = line(mark, module, std::thread::current().name(), reason);
    let _ = std::io::stderr().lock().write_all(text.as_bytes());
}

/// `mark crate::test: reason` and a newline: the crate is `module`'s first segment, the test
/// its thread's name (the harness names each test's thread after the test), or `module` where
/// the thread has none; a multi-line reason is put on one line.
pub fn line(mark: &str, module: &str, thread: Option<&str>, reason: &str) -> String {
    let krate = module.split("::").next().unwrap_or(module);
    let test = match thread {
        Some(name) if name != "main" => name,
        _ => module,
    };
    format!("{mark} {krate}::{test}: {}\n", reason.replace('\n', " "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_line_names_the_crate_the_test_and_the_reason() {
        // What `record` sees when called from this test.
        let here = line(
            SKIPPED,
            module_path!(),
            std::thread::current().name(),
            "no redis-server\non PATH",
        );
        assert_eq!(
            here,
            "SKIPPED: pegaflow_test_skip::tests::the_line_names_the_crate_the_test_and_the_reason: no redis-server on PATH\n"
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
