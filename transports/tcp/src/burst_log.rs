//! Rate limiting for log lines about events that come in floods (refused connections,
//! failing accepts): the first event of a burst is reported at once, the rest are counted
//! and reported as one summary line at most once per `every`, with their counts by label.
//!
//! Owns counters only: the caller writes the line, so the level, the message and the fields
//! stay at the call site. Must never: drop a count (every recorded event is in exactly one
//! [`Burst`]), block beyond a short mutex, or grow with the number of events (labels are
//! `&'static str`, a handful per caller).

use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// Counts events by label; says when a line about them is due.
///
/// `D` is a detail kept from the latest event (e.g. the peer address), reported with the
/// line.
#[derive(Debug)]
pub struct BurstLog<D = ()> {
    every: Duration,
    state: Mutex<State<D>>,
}

#[derive(Debug)]
struct State<D> {
    /// Events not reported yet, by label, in first-seen order.
    pending: Vec<(&'static str, u64)>,
    /// When the first and the latest of the pending events came.
    first: Option<Instant>,
    latest: Option<Instant>,
    /// The latest pending event's detail.
    last: Option<D>,
    /// When the last line was reported.
    last_line: Option<Instant>,
}

/// The events one line reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Burst<D = ()> {
    /// Events by label, in first-seen order.
    pub counts: Vec<(&'static str, u64)>,
    /// From the first of these events to the latest.
    pub over: Duration,
    /// The detail of the latest of them.
    pub last: Option<D>,
}

impl<D> Burst<D> {
    /// Events in all.
    pub fn total(&self) -> u64 {
        self.counts.iter().map(|(_, n)| n).sum()
    }

    /// Events under `label`.
    pub fn count(&self, label: &str) -> u64 {
        self.counts
            .iter()
            .find(|(l, _)| *l == label)
            .map_or(0, |(_, n)| *n)
    }

    /// `label=n` pairs, space-separated, in first-seen order (for a log field).
    pub fn by_label(&self) -> String {
        let v: Vec<String> = self
            .counts
            .iter()
            .map(|(l, n)| format!("{l}={n}"))
            .collect();
        v.join(" ")
    }
}

impl<D> BurstLog<D> {
    /// At most one line per `every` (the first event after a quiet `every` is reported at
    /// once).
    pub fn new(every: Duration) -> Self {
        Self {
            every,
            state: Mutex::new(State {
                pending: Vec::new(),
                first: None,
                latest: None,
                last: None,
                last_line: None,
            }),
        }
    }

    /// The shortest time between two lines.
    pub fn every(&self) -> Duration {
        self.every
    }

    /// Counts one event under `label` at `now`. `Some` when a line is due now (no line in
    /// the last `every`): it carries this event and every one counted since the last line.
    /// `None`: counted, to be reported by a later `record` or [`Self::flush`].
    pub fn record(&self, label: &'static str, detail: D, now: Instant) -> Option<Burst<D>> {
        let mut s = self.state.lock();
        match s.pending.iter_mut().find(|(l, _)| *l == label) {
            Some((_, n)) => *n += 1,
            None => s.pending.push((label, 1)),
        }
        s.first.get_or_insert(now);
        s.latest = Some(now);
        s.last = Some(detail);
        self.due_now(&s, now).then(|| Self::take(&mut s, now))
    }

    /// The events counted since the last line, when their line is due at `now` (a timer
    /// calls this at least once per `every`, so a burst's tail is reported too).
    pub fn flush(&self, now: Instant) -> Option<Burst<D>> {
        let mut s = self.state.lock();
        (!s.pending.is_empty() && self.due_now(&s, now)).then(|| Self::take(&mut s, now))
    }

    fn due_now(&self, s: &State<D>, now: Instant) -> bool {
        s.last_line
            .is_none_or(|t| now.saturating_duration_since(t) >= self.every)
    }

    fn take(s: &mut State<D>, now: Instant) -> Burst<D> {
        s.last_line = Some(now);
        let over = match (s.first.take(), s.latest.take()) {
            (Some(f), Some(l)) => l.saturating_duration_since(f),
            _ => Duration::ZERO,
        };
        Burst {
            counts: std::mem::take(&mut s.pending),
            over,
            last: s.last.take(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flood_makes_one_line_per_period_and_loses_no_count() {
        let log = BurstLog::new(Duration::from_secs(10));
        let t0 = Instant::now();
        let first = log
            .record("full", 1, t0)
            .expect("the first event is reported at once");
        assert_eq!((first.total(), first.last), (1, Some(1)));
        let mut lines = vec![first];
        // 19,920 more over 15 s, as the flood: one line at 10 s, the tail at flush.
        for i in 1..19_921u64 {
            let now = t0 + Duration::from_micros(i * 750);
            let label = if i % 2 == 0 { "full" } else { "per_address" };
            lines.extend(log.record(label, i, now));
            if i % 1000 == 0 {
                lines.extend(log.flush(now));
            }
        }
        assert_eq!(lines.len(), 2, "the first event, then one summary at 10 s");
        assert!(
            log.flush(t0 + Duration::from_secs(15)).is_none(),
            "not due yet"
        );
        lines.extend(log.flush(t0 + Duration::from_secs(21)));
        assert_eq!(lines.len(), 3, "the tail, once due");
        let total: u64 = lines.iter().map(Burst::total).sum();
        assert_eq!(total, 19_921, "every event is in exactly one line");
        let full: u64 = lines.iter().map(|b| b.count("full")).sum();
        assert_eq!(full, 1 + 9_960);
        assert_eq!(lines[2].last, Some(19_920));
        assert!(
            lines[2].over < Duration::from_secs(5),
            "{:?}",
            lines[2].over
        );
        assert!(lines[1].by_label().contains("per_address="));
        assert!(
            log.flush(t0 + Duration::from_secs(60)).is_none(),
            "nothing pending"
        );
    }

    #[test]
    fn an_event_after_a_quiet_period_is_reported_at_once() {
        let log: BurstLog = BurstLog::new(Duration::from_millis(100));
        let t0 = Instant::now();
        assert!(log.record("x", (), t0).is_some());
        assert!(log
            .record("x", (), t0 + Duration::from_millis(50))
            .is_none());
        let b = log
            .record("y", (), t0 + Duration::from_millis(150))
            .expect("a period has passed");
        assert_eq!(b.counts, vec![("x", 1), ("y", 1)]);
        assert_eq!(b.over, Duration::from_millis(100));
    }
}
