//! Start-up checks a backend can run for `--check-config` without side effects: what its
//! build would refuse that its settings alone cannot show (a directory this user cannot
//! create, huge pages the kernel does not have), found by reading the system, never by
//! creating, opening for writing, mapping or connecting anything.
//!
//! A backend submits a [`Preflight`] for its kind with `inventory::submit!`; the runtime runs
//! it on each pipeline entry of that kind, after the entry's settings passed
//! [`crate::plugin::ConfigSchema::check`], and prints the [`PreflightReport`]. Must never: have
//! a side effect, or block for long (a few file reads; no network).

use crate::factory::Section;

/// What start-up checks found: each line names the component and says what was seen.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct PreflightReport {
    /// Checks that passed (`dram tier: 512 free 2 MiB huge pages for 1 GiB`).
    pub passed: Vec<String>,
    /// What start-up would fail on (exit 1), with the remedy.
    pub failed: Vec<String>,
    /// What holds now but need not at start-up, or does not stop it (a port in use by a
    /// running server; a pool larger than the machine's memory).
    pub warnings: Vec<String>,
    /// What cannot be seen without a side effect; start-up finds it.
    pub not_checked: Vec<String>,
}

impl PreflightReport {
    /// Records a check that passed.
    pub fn pass(&mut self, line: impl Into<String>) {
        self.passed.push(line.into());
    }
    /// Records what start-up would fail on.
    pub fn fail(&mut self, line: impl Into<String>) {
        self.failed.push(line.into());
    }
    /// Records a warning.
    pub fn warn(&mut self, line: impl Into<String>) {
        self.warnings.push(line.into());
    }
    /// Records something start-up finds that this check cannot see.
    pub fn not_checked(&mut self, line: impl Into<String>) {
        self.not_checked.push(line.into());
    }
    /// Whether start-up would fail.
    pub fn ok(&self) -> bool {
        self.failed.is_empty()
    }
}

/// A backend's start-up check, run by `--check-config` on every pipeline entry of `kind` in
/// `section`.
#[derive(Debug)]
pub struct Preflight {
    /// Where the entry is: `[[tier]]`, `[[transport]]`, `[peer]`, ...
    pub section: Section,
    /// The kind it checks.
    pub kind: &'static str,
    /// Checks one entry: `what` names it (`ssd tier`), `settings` is its table (without
    /// `kind`), already accepted by the kind's settings check.
    pub check: fn(what: &str, settings: &toml::Table, report: &mut PreflightReport),
}

inventory::collect!(Preflight);

/// The checks submitted for `kind` in `section`.
pub fn preflights(section: Section, kind: &str) -> impl Iterator<Item = &'static Preflight> + '_ {
    inventory::iter::<Preflight>().filter(move |p| p.section == section && p.kind == kind)
}

/// Whether this user may create an entry in `dir` (write and search permission, by
/// `access(2)`, which answers for the real user; the server runs as that user), and if not,
/// why. `dir` must exist.
pub fn can_create_in(dir: &std::path::Path) -> Result<(), String> {
    use nix::unistd::{access, AccessFlags};
    // SAFETY: getuid cannot fail and has no preconditions.
    let uid = unsafe { libc::getuid() };
    match access(dir, AccessFlags::W_OK | AccessFlags::X_OK) {
        Ok(()) => Ok(()),
        Err(e) => Err(format!(
            "{} is not writable by this user (uid {}): {e}",
            dir.display(),
            uid
        )),
    }
}

/// Whether this user may read and write the existing file `path` (`access(2)`), and if not,
/// why.
pub fn can_read_write(path: &std::path::Path) -> Result<(), String> {
    use nix::unistd::{access, AccessFlags};
    access(path, AccessFlags::R_OK | AccessFlags::W_OK).map_err(|e| {
        format!(
            "{} cannot be read and written by this user: {e}",
            path.display()
        )
    })
}

/// For a path start-up creates when it is missing (with its missing parents): `Ok(None)` when
/// it exists, `Ok(Some(ancestor))` when it does not and this user can create it under its
/// nearest existing ancestor, `Err(why)` when it cannot be created.
pub fn creatable(path: &std::path::Path) -> Result<Option<std::path::PathBuf>, String> {
    if std::fs::symlink_metadata(path).is_ok() {
        return Ok(None);
    }
    let mut dir = path.parent();
    while let Some(d) = dir {
        let d = if d.as_os_str().is_empty() {
            std::path::Path::new(".")
        } else {
            d
        };
        match std::fs::metadata(d) {
            Ok(m) if m.is_dir() => return can_create_in(d).map(|()| Some(d.to_path_buf())),
            Ok(_) => return Err(format!("{} exists and is not a directory", d.display())),
            // Missing, or below a file (ENOTDIR): look further up for what is in the way.
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::NotFound | std::io::ErrorKind::NotADirectory
                ) =>
            {
                dir = d.parent()
            }
            Err(e) => return Err(format!("cannot stat {}: {e}", d.display())),
        }
    }
    Err(format!("no existing directory above {}", path.display()))
}
