//! The Redis directory's connection: one multiplexed connection, made by the first call,
//! dropped after a failure and made again by a later one, with the `run_id` of the server
//! it reached.

use std::sync::Arc;
use std::time::{Duration, Instant};

use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, RedisError};

/// One established connection and what was learnt when it was made.
#[derive(Clone)]
pub(super) struct Live {
    /// Distinguishes connections, so that a failed call drops only the one it used.
    pub id: u64,
    pub conn: MultiplexedConnection,
    /// The server process's `run_id` (`INFO server`); empty when the server hides it.
    pub run_id: Arc<str>,
}

#[derive(Default)]
struct LinkState {
    current: Option<Live>,
    next_id: u64,
    /// The last failed connection attempt: when, and why.
    failed: Option<(Instant, String)>,
}

/// A lazily made, remade-after-failure multiplexed connection. The state lock is never held
/// across an await; `connecting` lets one caller connect while the others wait for it (each
/// within its own call's timeout).
pub(super) struct Link {
    client: redis::Client,
    options: AsyncConnectionConfig,
    /// After a failed attempt, calls fail at once for this long instead of reconnecting.
    retry_after: Duration,
    state: parking_lot::Mutex<LinkState>,
    connecting: tokio::sync::Mutex<()>,
}

impl Link {
    /// A link to `client`'s server, not connected yet; after a failed attempt, calls fail at
    /// once for `retry_after`.
    pub fn new(
        client: redis::Client,
        options: AsyncConnectionConfig,
        retry_after: Duration,
    ) -> Self {
        Self {
            client,
            options,
            retry_after,
            state: parking_lot::Mutex::new(LinkState::default()),
            connecting: tokio::sync::Mutex::new(()),
        }
    }

    fn cached(&self) -> Option<Live> {
        self.state.lock().current.clone()
    }

    /// The current connection, made now if there is none (then `true` comes with it).
    pub async fn get(&self) -> Result<(Live, bool), String> {
        if let Some(l) = self.cached() {
            return Ok((l, false));
        }
        let _one = self.connecting.lock().await;
        {
            let st = self.state.lock();
            if let Some(l) = &st.current {
                return Ok((l.clone(), false));
            }
            if let Some((at, why)) = &st.failed {
                if at.elapsed() < self.retry_after {
                    return Err(why.clone());
                }
            }
        }
        match self.open().await {
            Ok((conn, run_id)) => {
                let mut st = self.state.lock();
                st.next_id += 1;
                let live = Live {
                    id: st.next_id,
                    conn,
                    run_id: run_id.into(),
                };
                st.current = Some(live.clone());
                st.failed = None;
                Ok((live, true))
            }
            Err(e) => {
                let why = format!("cannot connect: {e}");
                self.state.lock().failed = Some((Instant::now(), why.clone()));
                Err(why)
            }
        }
    }

    /// Connects and reads the server's `run_id`.
    async fn open(&self) -> redis::RedisResult<(MultiplexedConnection, String)> {
        let mut conn = self
            .client
            .get_multiplexed_async_connection_with_config(&self.options)
            .await?;
        let run_id = match redis::cmd("INFO")
            .arg("server")
            .query_async::<String>(&mut conn)
            .await
        {
            Ok(info) => info
                .lines()
                .find_map(|l| l.strip_prefix("run_id:"))
                .map(|s| s.trim().to_string())
                .unwrap_or_default(),
            Err(e) if is_link_error(&e) => return Err(e),
            Err(e) => {
                tracing::debug!(
                    "redis directory: INFO refused ({e}); restarts that keep data go unnoticed"
                );
                String::new()
            }
        };
        Ok((conn, run_id))
    }

    /// Forgets connection `id` (if it is still the current one) so the next call reconnects.
    pub fn drop_conn(&self, id: u64) {
        let mut st = self.state.lock();
        if st.current.as_ref().is_some_and(|l| l.id == id) {
            st.current = None;
        }
    }
}

/// Errors after which the connection is not trusted any more.
pub(super) fn is_link_error(e: &RedisError) -> bool {
    e.is_io_error() || e.is_timeout() || e.is_connection_dropped() || e.is_unrecoverable_error()
}

/// How one try of a call failed.
pub(super) enum Attempt {
    /// The connection broke (or was found broken): the commands may not have run.
    Dead(RedisError),
    /// Redis did not answer within the timeout.
    Silent,
    /// Redis answered with an error (out of memory, loading, a replica, ...).
    Refused(RedisError),
}
