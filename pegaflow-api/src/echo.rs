//! How a client-supplied string appears in an error message or a log line: a short prefix
//! and the length, never the whole of a value that could be megabytes (a hostile field would
//! otherwise fill the logs, or a status message past the client's header limit).

use std::fmt;

/// Characters of a client-supplied string an error message shows before cutting it.
pub const ECHO_PREFIX_CHARS: usize = 64;

/// A client-supplied string as error messages show it: whole when at most
/// [`ECHO_PREFIX_CHARS`] characters, else that many followed by `…(N bytes)`. `{:?}` quotes
/// the shown part.
#[derive(Clone, Copy)]
pub struct Echo<'a>(&'a str);

/// Wraps a client-supplied string for an error message (see [`Echo`]).
pub fn echo(s: &str) -> Echo<'_> {
    Echo(s)
}

impl<'a> Echo<'a> {
    /// The shown prefix, and whether it is the whole string.
    fn split(&self) -> (&'a str, bool) {
        match self.0.char_indices().nth(ECHO_PREFIX_CHARS) {
            Some((cut, _)) => (&self.0[..cut], false),
            None => (self.0, true),
        }
    }
}

impl fmt::Display for Echo<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.split() {
            (s, true) => f.write_str(s),
            (s, false) => write!(f, "{s}…({} bytes)", self.0.len()),
        }
    }
}

impl fmt::Debug for Echo<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.split() {
            (s, true) => write!(f, "{s:?}"),
            (s, false) => write!(f, "{s:?}…({} bytes)", self.0.len()),
        }
    }
}
