//! Rate limits for log lines a client can cause (refusals, registrations): a burst of lines
//! per window, then silence, the next line saying how many were held back.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// At most `burst` lines per `window`.
#[derive(Debug)]
pub struct Throttle {
    window: Duration,
    burst: u32,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    start: Option<Instant>,
    shown: u32,
    suppressed: u64,
}

impl Throttle {
    /// `burst` lines per `window`.
    pub const fn new(window: Duration, burst: u32) -> Self {
        Self {
            window,
            burst,
            state: Mutex::new(State {
                start: None,
                shown: 0,
                suppressed: 0,
            }),
        }
    }

    /// `Some(n)` when a line may be logged now, `n` being the lines held back since the last
    /// one; `None` when this one is held back.
    pub fn admit(&self) -> Option<u64> {
        let now = Instant::now();
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if s.start.is_none_or(|t| now.duration_since(t) >= self.window) {
            s.start = Some(now);
            s.shown = 0;
        }
        if s.shown < self.burst {
            s.shown += 1;
            Some(std::mem::take(&mut s.suppressed))
        } else {
            s.suppressed += 1;
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_then_silence_then_the_count() {
        let t = Throttle::new(Duration::from_millis(200), 3);
        assert_eq!(
            (0..10).filter_map(|_| t.admit()).collect::<Vec<_>>(),
            vec![0, 0, 0]
        );
        std::thread::sleep(Duration::from_millis(250));
        assert_eq!(t.admit(), Some(7));
        assert_eq!(t.admit(), Some(0));
    }
}
