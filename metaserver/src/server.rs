//! The process: builds the backend the flags name, binds the gRPC and HTTP listeners, runs
//! the in-memory directory's sweep timer, and serves until SIGINT or SIGTERM.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use pegaflow_directory::memory::{MemoryConfig, MemoryDirectory};
use pegaflow_directory::redis_dir::{RedisConfig, RedisDirectory};
use pegaflow_plugin::Directory;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::cli::Args;
use crate::grpc::MetaServerRouter;
use crate::http::{HttpState, HEALTH_NAMESPACE, HEALTH_TIMEOUT};
use crate::metrics::Metrics;
use crate::service::MetaService;

/// How long shutdown waits for in-flight requests.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// Installs the global log subscriber at `level` (a checked `--log-level`).
///
/// # Errors
/// The level does not parse, or a subscriber is already installed.
pub fn init_logging(level: &str) -> anyhow::Result<()> {
    let filter = tracing_subscriber::EnvFilter::try_new(level)
        .with_context(|| format!("invalid --log-level {level:?}"))?;
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .with_target(false)
        .try_init()
        .map_err(|e| anyhow::anyhow!("cannot install the logger: {e}"))
}

/// The directory the flags describe.
pub struct Backend {
    /// What the service answers from.
    pub dir: Arc<dyn Directory>,
    /// The same directory when it is the in-memory one (swept here, with store gauges).
    pub memory: Option<Arc<MemoryDirectory>>,
}

/// Builds the directory the flags describe: in memory, or the Redis `--redis` names.
///
/// # Errors
/// A setting the backend refuses (a Redis URL it cannot parse).
pub fn backend(args: &Args) -> anyhow::Result<Backend> {
    match &args.redis {
        None => {
            let cfg = MemoryConfig {
                stale_after_secs: args.node_stale_secs,
                ttl_minutes: args.ttl_minutes,
                min_reclaimable_owners: args.min_reclaimable_owner_count as usize,
                // The server runs the sweep itself (it counts the removals).
                sweep_interval_secs: 0,
                max_nodes: args.max_nodes,
                max_blocks_per_node: args.max_blocks_per_node,
                max_store_bytes: args.max_store_bytes.0,
            };
            cfg.check()?;
            let m = Arc::new(MemoryDirectory::new(&cfg));
            Ok(Backend {
                dir: m.clone(),
                memory: Some(m),
            })
        }
        Some(url) => {
            let cfg = RedisConfig {
                url: url.clone(),
                key_prefix: args.redis_key_prefix.clone(),
                stale_after_secs: args.node_stale_secs,
                ttl_minutes: args.ttl_minutes,
                timeout_ms: args.redis_timeout_ms,
                min_reclaimable_owners: args.min_reclaimable_owner_count,
                max_nodes: args.max_nodes,
                max_blocks_per_node: args.max_blocks_per_node,
                ..RedisConfig::default()
            };
            let r = RedisDirectory::connect(cfg).context("--redis")?;
            Ok(Backend {
                dir: Arc::new(r),
                memory: None,
            })
        }
    }
}

/// A running MetaServer.
pub struct Running {
    /// The bound gRPC address.
    pub grpc_addr: SocketAddr,
    /// The bound HTTP address.
    pub http_addr: SocketAddr,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

impl Running {
    /// Stops accepting, lets in-flight requests finish (at most [`SHUTDOWN_GRACE`]), and
    /// stops the sweep timer.
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        let all = futures_join(self.tasks);
        if tokio::time::timeout(SHUTDOWN_GRACE, all).await.is_err() {
            tracing::warn!(
                "shutdown: requests still in flight after {} s; leaving",
                SHUTDOWN_GRACE.as_secs()
            );
        }
    }
}

async fn futures_join(tasks: Vec<JoinHandle<()>>) {
    for t in tasks {
        let _ = t.await;
    }
}

fn stopped(rx: &watch::Receiver<bool>) -> impl std::future::Future<Output = ()> + Send + 'static {
    let mut rx = rx.clone();
    async move {
        // A dropped sender stops as well.
        let _ = rx.wait_for(|s| *s).await;
    }
}

/// Binds and starts serving `args` (the flags already checked).
///
/// # Errors
/// A listener cannot be bound, or the backend cannot be built.
pub async fn start(args: &Args) -> anyhow::Result<Running> {
    let Backend { dir, memory } = backend(args)?;
    let metrics = Arc::new(Metrics::new(memory.is_some()));
    metrics.set_limits(&args.caps(), memory.is_some());
    let grpc = tokio::net::TcpListener::bind(args.addr)
        .await
        .with_context(|| format!("cannot bind the gRPC address --addr {}", args.addr))?;
    let http = tokio::net::TcpListener::bind(args.http_addr)
        .await
        .with_context(|| {
            format!(
                "cannot bind the HTTP address --http-addr {}",
                args.http_addr
            )
        })?;
    let grpc_addr = grpc.local_addr()?;
    let http_addr = http.local_addr()?;
    let (stop, rx) = watch::channel(false);
    let mut tasks = Vec::new();

    let svc = MetaServerRouter::new(Arc::new(MetaService::new(dir.clone(), metrics.clone())));
    let incoming = tonic::transport::server::TcpIncoming::from(grpc).with_nodelay(Some(true));
    let grpc_stop = stopped(&rx);
    tasks.push(tokio::spawn(async move {
        let r = tonic::transport::Server::builder()
            .add_service(svc)
            .serve_with_incoming_shutdown(incoming, grpc_stop)
            .await;
        if let Err(e) = r {
            tracing::error!(error = %e, "gRPC server failed");
        }
    }));

    let app = crate::http::router(HttpState {
        dir: dir.clone(),
        memory: memory.clone(),
        metrics: metrics.clone(),
    });
    let http_stop = stopped(&rx);
    tasks.push(tokio::spawn(async move {
        if let Err(e) = axum::serve(http, app)
            .with_graceful_shutdown(http_stop)
            .await
        {
            tracing::error!(error = %e, "HTTP server failed");
        }
    }));

    if let Some(m) = &memory {
        tasks.push(tokio::spawn(sweep_loop(
            m.clone(),
            metrics.clone(),
            Duration::from_secs(args.sweep_interval_secs),
            stopped(&rx),
        )));
    }

    match &args.redis {
        None => tracing::info!(
            grpc = %grpc_addr,
            http = %http_addr,
            backend = "memory",
            node_stale_secs = args.node_stale_secs,
            ttl_minutes = args.ttl_minutes,
            sweep_interval_secs = args.sweep_interval_secs,
            min_reclaimable_owner_count = args.min_reclaimable_owner_count,
            max_nodes = args.max_nodes,
            max_blocks_per_node = args.max_blocks_per_node,
            max_store = %args.max_store_bytes,
            "pegaflow-metaserver serving"
        ),
        Some(_) => {
            tracing::info!(
                grpc = %grpc_addr,
                http = %http_addr,
                backend = "redis",
                key_prefix = %args.redis_key_prefix,
                timeout_ms = args.redis_timeout_ms,
                node_stale_secs = args.node_stale_secs,
                ttl_minutes = args.ttl_minutes,
                min_reclaimable_owner_count = args.min_reclaimable_owner_count,
                max_nodes = args.max_nodes,
                max_blocks_per_node = args.max_blocks_per_node,
                "pegaflow-metaserver serving"
            );
            let probe = vec![b"startup-probe".to_vec()];
            match tokio::time::timeout(
                HEALTH_TIMEOUT,
                dir.query_prefix(HEALTH_NAMESPACE, &probe, None),
            )
            .await
            {
                Ok(Ok(_)) => tracing::info!("redis directory reachable"),
                Ok(Err(e)) => tracing::warn!(
                    "redis directory not reachable yet ({e}); calls answer UNAVAILABLE until it is"
                ),
                Err(_) => tracing::warn!("redis directory did not answer the startup probe"),
            }
        }
    }
    Ok(Running {
        grpc_addr,
        http_addr,
        stop,
        tasks,
    })
}

/// Sweeps `dir` every `every` (the first one `every` after start) until `stop`.
async fn sweep_loop(
    dir: Arc<MemoryDirectory>,
    metrics: Arc<Metrics>,
    every: Duration,
    stop: impl std::future::Future<Output = ()>,
) {
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tokio::pin!(stop);
    loop {
        tokio::select! {
            _ = &mut stop => return,
            _ = tick.tick() => {}
        }
        let d = dir.clone();
        let Ok((counts, stats)) = tokio::task::spawn_blocking(move || {
            let c = d.sweep();
            (c, d.stats())
        })
        .await
        else {
            continue;
        };
        metrics.add_sweep(&counts);
        metrics.set_store(&stats);
        tracing::info!(
            removed_owners = counts.owners,
            removed_keys = counts.keys,
            removed_nodes = counts.nodes,
            keys_left = stats.entries,
            "directory sweep"
        );
    }
}

/// Serves `args` until SIGINT or SIGTERM.
///
/// # Errors
/// As [`start`]; a signal handler cannot be installed.
pub async fn run(args: Args) -> anyhow::Result<()> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("cannot install the SIGTERM handler")?;
    let running = start(&args).await?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: shutting down"),
        _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
    }
    running.shutdown().await;
    tracing::info!("pegaflow-metaserver stopped");
    Ok(())
}
