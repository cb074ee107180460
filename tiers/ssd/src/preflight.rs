//! `--check-config`'s start-up check of an `ssd` tier: each path as [`crate::dir::Dir::open`]
//! will treat it (an existing directory or regular file it can write, or a directory it can
//! create under the nearest existing one), found without creating or opening anything for
//! writing. Free space, the lock and the store's own format are checked at start-up only.

use pegaflow_plugin::{can_create_in, can_read_write, creatable, parse_settings, PreflightReport};

use crate::SsdConfig;

/// Checks every path of the `ssd` entry `what`.
pub(crate) fn preflight(what: &str, table: &toml::Table, r: &mut PreflightReport) {
    let Ok(config) = parse_settings::<SsdConfig>(what, table) else {
        return;
    };
    for path in &config.paths {
        let shown = path.display();
        match std::fs::metadata(path) {
            Ok(m) if m.is_dir() => match can_create_in(path) {
                Ok(()) => r.pass(format!(
                    "{what}: {shown} is a directory this user can write"
                )),
                Err(why) => r.fail(format!("{what}: {shown}: {why}")),
            },
            Ok(m) if m.is_file() => match can_read_write(path) {
                Ok(()) => r.pass(format!(
                    "{what}: {shown} is a regular file this user can read and write"
                )),
                Err(why) => r.fail(format!("{what}: {why}")),
            },
            Ok(_) => r.fail(format!(
                "{what}: {shown} is neither a directory nor a regular file"
            )),
            Err(_) => match creatable(path) {
                Ok(Some(under)) => r.pass(format!(
                    "{what}: {shown} does not exist: start-up creates it under {} (logged at INFO)",
                    under.display()
                )),
                Ok(None) => r.pass(format!("{what}: {shown} exists")),
                Err(why) => r.fail(format!("{what}: {shown} cannot be created: {why}")),
            },
        }
    }
    r.not_checked(format!(
        "{what}: free space against the capacity, the lock on each path (another server using it) and an existing store's format: checked when the tier opens"
    ));
}
