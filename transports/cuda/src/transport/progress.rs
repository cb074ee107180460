//! The copy's progress as its caller sees it before the answer: the near end of a batch, and
//! the moment a device → host batch has read every byte of its device memory.
//!
//! This is the one place the `cuda` transport touches the runtime's progress API: it takes the
//! calling operation's `pegaflow_plugin::SourceRead` listener when a batch is submitted
//! ([`ReadListener::of_caller`]), fires it ([`ReadListener::fire`]) and calls
//! `pegaflow_plugin::signal_near_end` ([`signal_near_end`]); the rest of the transport only
//! sees the types of this module. (Both are task-locals of the calling operation today.)
//!
//! Owns: carrying a batch's signals from the caller to its worker and back ([`BatchSignals`]).
//! Must never: fire the source-read listener before every byte of the batch's device memory was
//! read (the server then answers the Save, and the client may overwrite that memory), or signal
//! the near end outside the calling operation's task.

use pegaflow_plugin::{Direction, SourceRead};
use tokio::sync::oneshot;

/// The calling operation's source-read listener, carried with a device → host batch to its
/// worker: fired once the batch's staged gathers have read all of its device memory.
pub(super) struct ReadListener(SourceRead);

impl ReadListener {
    /// The listener of the operation whose task calls this, for a batch of `direction`: only a
    /// device → host batch whose caller installed one (the server does for Saves, `[server]
    /// save_answer_early`) has one.
    pub(super) fn of_caller(direction: Direction) -> Option<Self> {
        if direction == Direction::ToHost {
            SourceRead::current().map(Self)
        } else {
            None
        }
    }

    /// Tells the listener that no byte of the batch reads device memory any more.
    pub(super) fn fire(&self) {
        self.0.fire();
    }
}

/// Tells the operation whose task calls this that its copy is near its end (under
/// `wait = "tail"`, from the batch's tail on): the server then sends a Save's response headers.
pub(super) fn signal_near_end() {
    pegaflow_plugin::signal_near_end();
}

/// The running batch's signals to its caller, held by its worker from the batch's start until
/// its wait ([`super::worker`]).
pub(super) struct BatchSignals {
    /// The batch's `Job::near_end`: sent when the worker starts polling for the batch's end
    /// (the caller then polls for the answer, and signals the near end), dropped unsent when
    /// the batch fails before that.
    pub(super) near_end: Option<oneshot::Sender<()>>,
    /// The batch's `Job::source_read`.
    pub(super) source_read: Option<ReadListener>,
}

impl BatchSignals {
    /// No batch running.
    pub(super) const NONE: Self = Self {
        near_end: None,
        source_read: None,
    };
}
