//! Assembling and running a server from a pipeline: build the plugins, bind the side channel,
//! start the engine's housekeeping, the gRPC service and the HTTP endpoints.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tokio::task::JoinHandle;

use crate::cluster::{ClusterDirectory, DirectoryConfig};
use crate::config::PipelineConfig;
use crate::engine::{Engine, EngineParts};
use crate::fd_channel::{FdChannel, FdChannelLimits};
use crate::metrics::Metrics;
use crate::plugin::{
    directory_factory, known_tiers, peer_service_factory, registrar_factory, tier_factory,
    transport_factory, BuiltTier, HostPool, NodeId, PayloadCarrier, PeerService, Registrar,
    RegistrarFactory, RuntimeContext, Tier, Transport, TransportFactory,
};
use crate::service::EngineService;

/// A running server. Dropping it does not stop it: call [`ServerHandle::shutdown`].
pub struct ServerHandle {
    /// The bound gRPC address (useful with port 0).
    pub grpc_addr: SocketAddr,
    /// The bound HTTP address.
    pub http_addr: SocketAddr,
    /// The engine (for in-process tests and benchmarks).
    pub engine: Arc<Engine>,
    /// The side channel, when configured.
    pub fd_channel: Option<Arc<FdChannel>>,
    /// The cross-node directory client, when `[directory]` is configured.
    pub directory: Option<ClusterDirectory>,
    stop: Arc<Notify>,
    shutdown_requested: Arc<Notify>,
    tasks: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for ServerHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerHandle")
            .field("grpc_addr", &self.grpc_addr)
            .field("http_addr", &self.http_addr)
            .finish()
    }
}

impl ServerHandle {
    /// The gRPC endpoint as a URL (`http://host:port`).
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.grpc_addr)
    }

    /// Resolves when a client sent the Shutdown RPC.
    pub async fn shutdown_requested(&self) {
        self.shutdown_requested.notified().await;
    }

    /// Stops serving gRPC and HTTP, then unregisters every instance — fence, drain their
    /// copies, release their registrations — waiting at most `drain_timeout` for that (a wedged
    /// device must not keep the process from exiting; the OS reclaims what is left).
    pub async fn shutdown(self) {
        self.shutdown_within(std::time::Duration::from_secs(10))
            .await
    }

    /// [`ServerHandle::shutdown`] with an explicit drain timeout.
    pub async fn shutdown_within(self, drain_timeout: std::time::Duration) {
        // Leave the directory first: peers stop being sent here while the rest winds down.
        if let Some(d) = &self.directory {
            d.stop().await;
        }
        self.stop.notify_waiters();
        // The first task is the housekeeping loop; the others are the gRPC and HTTP servers,
        // which finish in-flight requests (a Shutdown RPC's own answer among them) before they
        // stop. Open Session streams never end by themselves: give the servers a moment, then
        // cut what is left.
        let mut tasks = self.tasks.into_iter();
        if let Some(gc) = tasks.next() {
            gc.abort();
        }
        let grace = tokio::time::Instant::now() + std::time::Duration::from_secs(2);
        for mut t in tasks {
            if tokio::time::timeout_at(grace, &mut t).await.is_err() {
                t.abort();
                let _ = t.await;
            }
        }
        match tokio::time::timeout(drain_timeout, self.engine.unregister_all()).await {
            Ok((ids, tensors)) if !ids.is_empty() => {
                tracing::info!(
                    instances = ids.len(),
                    tensors,
                    "drained and released every instance"
                )
            }
            Ok(_) => {}
            Err(_) => tracing::warn!(
                "instances still draining after {drain_timeout:?}; exiting without waiting for them"
            ),
        }
        // The demotion worker's write in flight ends and it drops its hold on the lower
        // tiers: a restart in this process finds an SSD directory unlocked.
        if tokio::time::timeout(drain_timeout, self.engine.store().stop_and_join())
            .await
            .is_err()
        {
            tracing::warn!("a demotion write is still running after {drain_timeout:?}; exiting without waiting for it");
        }
    }
}

/// Builds the plugins of `pipeline` and starts serving. Returns once both listeners are bound.
pub async fn start(pipeline: PipelineConfig) -> anyhow::Result<ServerHandle> {
    // Bind first: a taken port fails start-up before any memory is mapped or pinned.
    let grpc_listener = TcpListener::bind(pipeline.grpc_addr()?)
        .await
        .with_context(|| format!("cannot listen for gRPC on {}", pipeline.server.addr))?;
    let grpc_addr = grpc_listener.local_addr()?;
    let http_listener = TcpListener::bind(pipeline.http_addr()?)
        .await
        .with_context(|| format!("cannot listen for HTTP on {}", pipeline.server.http_addr))?;
    let http_addr = http_listener.local_addr()?;
    let metrics = Arc::new(Metrics::new());
    let fd_channel = match &pipeline.fd_channel {
        Some(c) => Some(
            FdChannel::bind(&c.path, FdChannelLimits::default())
                .await
                .with_context(|| {
                    format!("cannot bind the fd side channel at {}", c.path.display())
                })?,
        ),
        None => None,
    };
    let ctx = RuntimeContext {
        fd_channel: fd_channel.clone(),
        devices: pipeline.server.devices.clone(),
        index_events: Default::default(),
        metrics: metrics.clone(),
        health: Default::default(),
    };
    let built = build_pipeline(&pipeline, &ctx, &metrics)?;
    let directory = match &pipeline.directory {
        Some(d) => {
            let f = directory_factory(&d.kind)?;
            let backend = (f.build)(&d.settings, &ctx)
                .with_context(|| format!("cannot build the {:?} directory", d.kind))?;
            Some((
                backend,
                advertised_addr(d, &pipeline.server.addr, grpc_addr),
            ))
        }
        None => None,
    };
    tracing::info!(
        pool = built.pool.kind(),
        capacity_bytes = built.pool.capacity_bytes(),
        lower_tiers = ?built.lower.iter().map(|t| t.kind()).collect::<Vec<_>>(),
        transports = ?built.transports.iter().map(|t| t.kind()).collect::<Vec<_>>(),
        registrars = ?built.registrars.iter().map(|t| t.kind()).collect::<Vec<_>>(),
        "pipeline built"
    );
    let engine = Engine::new(EngineParts {
        config: pipeline.engine.clone(),
        pool: built.pool,
        lower_tiers: built.lower,
        store: pipeline.store.clone(),
        index_events: ctx.index_events.clone(),
        peer: built.peer,
        registrars: built.registrars,
        transports: built.transports,
        metrics,
        fd_channel: fd_channel.clone(),
    })?;
    engine.store().recover().await?;
    let directory = directory.map(|(backend, addr)| {
        let config = pipeline.directory.clone().expect("built from [directory]");
        tracing::info!(directory = backend.kind(), node = %addr, "joining the cross-node directory");
        ClusterDirectory::start(
            backend,
            NodeId::new_session(addr),
            config,
            engine.store().clone(),
            engine.metrics().registry(),
            ctx.health.clone(),
        )
    });

    let stop = Arc::new(Notify::new());
    let shutdown_requested = Arc::new(Notify::new());
    let mut tasks = Vec::new();

    // Housekeeping: lease expiry, stale unsealed blocks, gauges.
    {
        let engine = engine.clone();
        let fdc = fd_channel.clone();
        tasks.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(30));
            loop {
                tick.tick().await;
                engine.gc();
                if let Some(c) = &fdc {
                    engine.metrics().fd_channel_pending.set(c.pending() as i64);
                }
            }
        }));
    }

    let svc = EngineService::new(
        engine.clone(),
        shutdown_requested.clone(),
        fd_channel
            .as_ref()
            .map(|c| c.path().to_string_lossy().into_owned()),
    );
    {
        let stop = stop.clone();
        // TCP_NODELAY on every accepted connection: without it a small response segment waits
        // for the client's delayed ACK (~40 ms stalls between RPCs).
        let incoming =
            tonic::transport::server::TcpIncoming::from(grpc_listener).with_nodelay(Some(true));
        tasks.push(tokio::spawn(async move {
            let r = tonic::transport::Server::builder()
                .http2_keepalive_interval(None)
                .max_concurrent_streams(Some(4096))
                // Large flow-control windows: a 256-block Save request is ~300 KB, which the
                // default 64 KiB stream window would split into several round trips.
                .initial_stream_window_size(Some(8 << 20))
                .initial_connection_window_size(Some(32 << 20))
                .add_service(svc.into_server())
                .serve_with_incoming_shutdown(incoming, async move { stop.notified().await })
                .await;
            if let Err(e) = r {
                tracing::error!(error = %e, "gRPC server failed");
            }
        }));
    }
    {
        let stop = stop.clone();
        let app = crate::http::router(
            engine.clone(),
            ctx.health.clone(),
            pipeline.server.enable_prometheus,
        );
        tasks.push(tokio::spawn(async move {
            let r = axum::serve(http_listener, app)
                .with_graceful_shutdown(async move { stop.notified().await })
                .await;
            if let Err(e) = r {
                tracing::error!(error = %e, "HTTP server failed");
            }
        }));
    }
    tracing::info!(%grpc_addr, %http_addr, fd_channel = ?pipeline.fd_channel.as_ref().map(|c| &c.path), "serving");
    Ok(ServerHandle {
        grpc_addr,
        http_addr,
        engine,
        fd_channel,
        directory,
        stop,
        shutdown_requested,
        tasks,
    })
}

/// The `ip:port` this server advertises in the directory: `advertise_addr`, else the
/// configured gRPC address (the bound one when its port is 0). Warns when peers on other
/// hosts could not reach it (loopback or unspecified).
fn advertised_addr(d: &DirectoryConfig, configured: &str, bound: SocketAddr) -> String {
    let addr = match &d.advertise_addr {
        Some(a) => a.clone(),
        None => match configured.parse::<SocketAddr>() {
            Ok(c) if c.port() == 0 => bound.to_string(),
            _ => configured.to_string(),
        },
    };
    match addr.parse::<SocketAddr>() {
        Ok(a) if a.ip().is_unspecified() => tracing::warn!(
            node = %addr,
            "the advertised address is unspecified: peers cannot reach it; set [directory] advertise_addr"
        ),
        Ok(a) if a.ip().is_loopback() => tracing::warn!(
            node = %addr,
            "the advertised address is loopback: only peers on this host can reach it"
        ),
        _ => {}
    }
    addr
}

/// The backends of a pipeline, built and wired: layers applied, host memory installed into
/// every transport.
pub struct BuiltPipeline {
    /// The landing pool.
    pub pool: Arc<dyn HostPool>,
    /// Lower tiers, in fall-through order.
    pub lower: Vec<Arc<dyn Tier>>,
    /// Transports, in preference order.
    pub transports: Vec<Arc<dyn Transport>>,
    /// Registrars (without those of per-layer blobs when `python_registry` is off).
    pub registrars: Vec<Arc<dyn Registrar>>,
    /// The server-to-server RPC delegate (`[peer]`), if any.
    pub peer: Option<Arc<dyn PeerService>>,
}

impl std::fmt::Debug for BuiltPipeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BuiltPipeline")
            .field("pool", &self.pool.kind())
            .field("lower", &self.lower.len())
            .field("transports", &self.transports.len())
            .field("registrars", &self.registrars.len())
            .finish()
    }
}

/// Builds every backend of `pipeline` through the plugin registry: the first `[[tier]]` must
/// be a landing pool and the others key-addressed tiers; `layers` wrap tiers and transports;
/// the pool's (and tiers') host regions are installed into every transport.
///
/// # Errors
/// An unknown kind or layer (listing the known ones), a factory's own error, a landing tier
/// that is not first (or a second one), a pipeline without a tier.
pub fn build_pipeline(
    pipeline: &PipelineConfig,
    ctx: &RuntimeContext,
    metrics: &Arc<Metrics>,
) -> anyhow::Result<BuiltPipeline> {
    let mut pool: Option<Arc<dyn HostPool>> = None;
    let mut lower = Vec::new();
    for (i, t) in pipeline.tiers.iter().enumerate() {
        let f = tier_factory(&t.kind)?;
        let built = (f.build)(&t.settings, ctx)
            .with_context(|| format!("cannot build tier {:?}", t.kind))?;
        match built {
            BuiltTier::Landing(p) if i == 0 => {
                if !t.layers.is_empty() {
                    anyhow::bail!(
                        "tier {:?}: layers wrap key-addressed tiers, not the landing pool",
                        t.kind
                    );
                }
                pool = Some(p);
            }
            BuiltTier::Landing(_) => anyhow::bail!(
                "tier {:?} is a landing (host DRAM) tier: only the first [[tier]] may be one",
                t.kind
            ),
            BuiltTier::Block(_) if i == 0 => anyhow::bail!(
                "the first [[tier]] must be a landing (host DRAM) tier; {:?} is a key-addressed tier below it",
                t.kind
            ),
            BuiltTier::Block(b) => lower.push(
                crate::plugin::wrap_tier(b, &t.layers, metrics)
                    .with_context(|| format!("tier {:?}", t.kind))?,
            ),
        }
    }
    let pool = pool.ok_or_else(|| {
        anyhow::anyhow!(
            "the pipeline has no tier; add a [[tier]] of a landing kind (this binary knows: {})",
            known_tiers()
        )
    })?;
    let mut transports = Vec::new();
    match &pipeline.transports {
        Some(list) => {
            for t in list {
                let f = transport_factory(&t.kind)?;
                let built = (f.build)(&t.settings, ctx)
                    .with_context(|| format!("cannot build transport {:?}", t.kind))?;
                transports.push(
                    crate::plugin::wrap_transport(built, &t.layers, metrics)
                        .with_context(|| format!("transport {:?}", t.kind))?,
                );
            }
        }
        None => {
            for f in inventory::iter::<TransportFactory>() {
                transports.push(
                    (f.build)(&toml::Table::new(), ctx)
                        .with_context(|| format!("cannot build transport {:?}", f.kind))?,
                );
            }
        }
    }
    let regions = pool.regions();
    for t in &transports {
        t.install_host_memory(&regions).map_err(|e| {
            anyhow::anyhow!("transport {:?} cannot install host memory: {e}", t.kind())
        })?;
    }
    let registrars = match &pipeline.registrars {
        Some(list) => list
            .iter()
            .map(|t| {
                let f = registrar_factory(&t.kind)?;
                (f.build)(&t.settings, ctx)
                    .with_context(|| format!("cannot build registrar {:?}", t.kind))
            })
            .collect::<anyhow::Result<Vec<_>>>()?,
        None => inventory::iter::<RegistrarFactory>()
            .map(|f| {
                (f.build)(&toml::Table::new(), ctx)
                    .with_context(|| format!("cannot build registrar {:?}", f.kind))
            })
            .collect::<anyhow::Result<Vec<_>>>()?,
    };
    let registrars: Vec<_> = if pipeline.server.python_registry {
        registrars
    } else {
        registrars
            .into_iter()
            .filter(|r| r.scheme().carrier != PayloadCarrier::LayerBlobs)
            .collect()
    };
    let peer = match &pipeline.peer {
        Some(p) => {
            let f = peer_service_factory(&p.kind)?;
            Some(
                (f.build)(&p.settings, ctx)
                    .with_context(|| format!("cannot build peer delegate {:?}", p.kind))?,
            )
        }
        None => None,
    };
    Ok(BuiltPipeline {
        pool,
        lower,
        transports,
        registrars,
        peer,
    })
}

/// Runs a server until SIGINT, SIGTERM or the Shutdown RPC.
pub async fn run(pipeline: PipelineConfig) -> anyhow::Result<()> {
    let handle = start(pipeline).await?;
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: shutting down"),
        _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
        _ = handle.shutdown_requested() => tracing::info!("Shutdown RPC: shutting down"),
    }
    handle.shutdown().await;
    tracing::info!("stopped");
    Ok(())
}

/// Installs the global log subscriber with `level` (a level or a tracing filter directive).
pub fn init_logging(level: &str) -> anyhow::Result<()> {
    let filter = tracing_subscriber::EnvFilter::try_new(level)
        .with_context(|| format!("invalid --log-level {level:?}"))?;
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stdout().is_terminal())
        .with_target(false)
        .try_init()
        .map_err(|e| anyhow::anyhow!("cannot install the logger: {e}"))
}
