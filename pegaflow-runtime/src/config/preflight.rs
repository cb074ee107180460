//! `--check-config`'s start-up checks: what start-up would refuse that the pipeline's text
//! cannot show, found without side effects. The runtime checks its own parts (the listen
//! addresses, the side channel's path); each backend's [`crate::plugin::Preflight`] checks its
//! entries; what nothing can see without building the backend is listed as not checked.
//!
//! Must never: create, open for writing, map or connect anything (binding a port for an
//! instant and closing it again is the one exception: it is how to learn that the port is
//! free, and leaves nothing behind).

use std::net::SocketAddr;
use std::path::Path;

use super::PipelineConfig;
use crate::plugin::{
    creatable, preflights, PreflightReport, RegistrarFactory, Section, TransportFactory,
};

impl PipelineConfig {
    /// What `--check-config` prints for a pipeline that passed [`Self::check`], and whether
    /// start-up would pass the checks of [`Self::preflight`] (`report`): a headline (`pipeline
    /// is valid`, or `start-up would fail: ...`), what will run ([`Self::describe`]), then
    /// every check with its outcome and what was not checked.
    pub fn render_check(&self, report: &PreflightReport) -> String {
        use std::fmt::Write;
        let mut o = String::new();
        if report.ok() {
            let _ = writeln!(o, "pipeline is valid");
        } else {
            let n = report.failed.len();
            let _ = writeln!(
                o,
                "start-up would fail: {n} problem{} below (the pipeline's settings are valid)",
                if n == 1 { "" } else { "s" }
            );
        }
        o.push_str(&self.describe());
        let _ = writeln!(
            o,
            "start-up checks (nothing was created, mapped or connected):"
        );
        for (tag, lines) in [
            ("FAIL", &report.failed),
            ("warn", &report.warnings),
            ("ok  ", &report.passed),
        ] {
            for l in lines {
                let _ = writeln!(o, "  {tag}  {l}");
            }
        }
        if !report.not_checked.is_empty() {
            let _ = writeln!(o, "not checked (start-up finds these):");
            for l in &report.not_checked {
                let _ = writeln!(o, "  -  {l}");
            }
        }
        o
    }

    /// Runs the start-up checks that need no side effect (see the module doc); call it on a
    /// pipeline that passed [`Self::check`].
    pub fn preflight(&self) -> PreflightReport {
        let mut r = PreflightReport::default();
        check_port(&mut r, "grpc addr", self.grpc_addr().ok());
        check_port(&mut r, "http addr", self.http_addr().ok());
        if let Some(c) = &self.fd_channel {
            check_fd_socket(&mut r, &c.path);
        }
        let mut unchecked: Vec<String> = Vec::new();
        let mut run = |section: Section, kind: &str, settings: &toml::Table| {
            let what = format!("{kind} {}", section.noun());
            let mut any = false;
            for p in preflights(section, kind) {
                (p.check)(&what, settings, &mut r);
                any = true;
            }
            if !any {
                unchecked.push(what);
            }
        };
        let empty = toml::Table::new();
        for t in &self.tiers {
            run(Section::Tier, &t.kind, &t.settings);
        }
        match &self.transports {
            Some(l) => l
                .iter()
                .for_each(|t| run(Section::Transport, &t.kind, &t.settings)),
            None => inventory::iter::<TransportFactory>()
                .for_each(|f| run(Section::Transport, f.kind, &empty)),
        }
        match &self.registrars {
            Some(l) => l
                .iter()
                .for_each(|t| run(Section::Registrar, &t.kind, &t.settings)),
            None => inventory::iter::<RegistrarFactory>()
                .for_each(|f| run(Section::Registrar, f.kind, &empty)),
        }
        if let Some(d) = &self.directory {
            run(Section::Directory, &d.kind, &d.settings);
        }
        if let Some(p) = &self.peer {
            run(Section::Peer, &p.kind, &p.settings);
        }
        if !unchecked.is_empty() {
            r.not_checked(format!(
                "{}: built at start-up, which opens the libraries, devices and sockets they need",
                unchecked.join(", ")
            ));
        }
        if let Some(d) = &self.directory {
            r.not_checked(format!(
                "the {} directory's reachability: connected after start-up (the server serves meanwhile; /health?verbose=1 says when it is reached)",
                d.kind
            ));
        }
        r
    }
}

/// Whether `addr` can be bound now: bound and closed at once. In use: a warning (a running
/// server, maybe this pipeline's own, holds it; start-up fails while it does); any other
/// refusal (an address of no interface here, a port below 1024 without the privilege) fails.
fn check_port(r: &mut PreflightReport, what: &str, addr: Option<SocketAddr>) {
    let Some(addr) = addr else { return };
    match std::net::TcpListener::bind(addr) {
        Ok(l) => {
            drop(l);
            r.pass(format!("{what} {addr}: can be bound"));
        }
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => r.warn(format!(
            "{what} {addr}: in use now (a running server?): start-up fails while it is"
        )),
        Err(e) => r.fail(format!("{what} {addr}: cannot be bound: {e}")),
    }
}

/// The side channel's path as start-up treats it: a missing path is bound (its missing
/// directories created, mode 0700), a socket is replaced when nobody listens on it, anything
/// else is refused.
fn check_fd_socket(r: &mut PreflightReport, path: &Path) {
    let what = format!("fd channel {}", path.display());
    if let Err(e) = nix::sys::socket::UnixAddr::new(path) {
        r.fail(format!("{what}: not a Unix socket address: {e}"));
        return;
    }
    match std::fs::symlink_metadata(path) {
        Ok(m) => {
            use std::os::unix::fs::FileTypeExt;
            if m.file_type().is_socket() {
                r.warn(format!(
                    "{what}: a socket exists there: start-up replaces it if nobody listens on it, and fails if a server does"
                ));
            } else {
                r.fail(format!(
                    "{what}: exists and is not a socket: start-up refuses to replace it"
                ));
            }
        }
        Err(_) => match creatable(path) {
            Ok(Some(dir))
                if dir.as_path()
                    == path
                        .parent()
                        .filter(|p| !p.as_os_str().is_empty())
                        .unwrap_or(Path::new(".")) =>
            {
                r.pass(format!("{what}: can be created in {}", dir.display()));
            }
            Ok(Some(dir)) => r.pass(format!(
                "{what}: start-up creates its missing directories under {} (mode 0700)",
                dir.display()
            )),
            Ok(None) => r.pass(format!("{what}: can be created")),
            Err(why) => r.fail(format!("{what}: cannot be created: {why}")),
        },
    }
}
