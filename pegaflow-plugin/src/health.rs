//! Component health: backends and the runtime post what an operator should see (the I/O
//! engine a tier chose, a directory taken out of service, each tier and peer path of the
//! pipeline) and the HTTP endpoints render it.
//!
//! `GET /health` is the probe, and answers as PegaFlow's does: exactly `ok` (200) while the
//! server serves, whatever is degraded, since a degraded component (a failed SSD directory, an
//! unreachable directory) leaves the server serving; 503 only when a component is
//! [`HealthState::Unhealthy`] (the server cannot serve: its gRPC service stopped). The detail,
//! one line per component with its state and reason ([`HealthBoard::render`]), is
//! `GET /health?verbose=1`. Must never: make the probe's body anything but `ok` while it
//! answers 200 (probes compare the body).

use std::collections::BTreeMap;
use std::sync::Arc;

use parking_lot::Mutex;

/// The state of one component.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HealthState {
    /// Working as configured.
    Ok,
    /// Serving with less than it was configured with (a failed directory dropped from
    /// service, a fallback engine): the server keeps serving.
    Degraded,
    /// Not serving what it is for (the gRPC service stopped): `/health` answers 503, so a
    /// probe restarts or routes around the server.
    Unhealthy,
}

impl HealthState {
    /// `ok`, `degraded` or `unhealthy`.
    pub fn as_str(self) -> &'static str {
        match self {
            HealthState::Ok => "ok",
            HealthState::Degraded => "degraded",
            HealthState::Unhealthy => "unhealthy",
        }
    }
}

#[derive(Debug, Clone)]
struct Report {
    state: HealthState,
    detail: String,
}

/// Reports by component name (`ssd /nvme0/pegaflow`), shared by every clone.
#[derive(Debug, Clone, Default)]
pub struct HealthBoard {
    reports: Arc<Mutex<BTreeMap<String, Report>>>,
}

impl HealthBoard {
    /// Sets (replaces) the report of `component`; `detail` is one line for operators.
    pub fn report(&self, component: &str, state: HealthState, detail: impl Into<String>) {
        self.reports.lock().insert(
            component.to_owned(),
            Report {
                state,
                detail: detail.into(),
            },
        );
    }

    /// Sets the report of `component` unless one is there already (a backend's own report
    /// wins over the runtime's baseline line for the same component).
    pub fn report_if_absent(&self, component: &str, state: HealthState, detail: impl Into<String>) {
        self.reports
            .lock()
            .entry(component.to_owned())
            .or_insert_with(|| Report {
                state,
                detail: detail.into(),
            });
    }

    /// Whether any component is degraded or unhealthy.
    pub fn degraded(&self) -> bool {
        self.overall() != HealthState::Ok
    }

    /// The worst state of any component (`Ok` without reports).
    pub fn overall(&self) -> HealthState {
        let reports = self.reports.lock();
        let any = |s: HealthState| reports.values().any(|r| r.state == s);
        if any(HealthState::Unhealthy) {
            HealthState::Unhealthy
        } else if any(HealthState::Degraded) {
            HealthState::Degraded
        } else {
            HealthState::Ok
        }
    }

    /// The detail (`/health?verbose=1`): the overall state ([`Self::overall`]) on the first
    /// line, then one `component: state; detail` line per report, in name order. Just `ok`
    /// without reports.
    pub fn render(&self) -> String {
        let mut out = String::from(self.overall().as_str());
        for (name, r) in self.reports.lock().iter() {
            out.push_str(&format!("\n{name}: {}; {}", r.state.as_str(), r.detail));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_board_says_ok_and_a_degraded_component_says_so() {
        let b = HealthBoard::default();
        assert_eq!(b.render(), "ok");
        b.report("ssd /a", HealthState::Ok, "io=posix");
        assert_eq!(b.render(), "ok\nssd /a: ok; io=posix");
        assert!(!b.degraded());
        b.report("ssd /b", HealthState::Degraded, "8 write errors in a row");
        assert!(b.degraded());
        assert_eq!(
            b.render(),
            "degraded\nssd /a: ok; io=posix\nssd /b: degraded; 8 write errors in a row"
        );
        b.report("ssd /b", HealthState::Ok, "back");
        assert!(!b.degraded());
        b.report_if_absent("ssd /b", HealthState::Degraded, "baseline");
        assert_eq!(b.overall(), HealthState::Ok, "a report already there wins");
        b.report("grpc", HealthState::Unhealthy, "stopped");
        b.report("ssd /a", HealthState::Degraded, "slow");
        assert_eq!(b.overall(), HealthState::Unhealthy);
        assert!(b
            .render()
            .starts_with("unhealthy\ngrpc: unhealthy; stopped\n"));
    }
}
