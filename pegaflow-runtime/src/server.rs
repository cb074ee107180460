//! Assembling and running a server from a pipeline: build the plugins, bind the side channel,
//! start the engine's housekeeping, the gRPC service and the HTTP endpoints.
//!
//! It also owns the accept loops of both listeners (`CappedListener`): each holds at most
//! its cap of connections (`[server] max_connections`, `max_http_connections`) and accepts
//! and closes one more at once, so a flood neither takes every descriptor nor fills the
//! kernel backlog; an accept that fails for lack of descriptors or memory backs off instead
//! of spinning. It must never drop a held connection to make room for a new one.

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
use crate::health::{HealthBoard, HealthState};
use crate::http::PeerAddr;
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
    /// What `/health` answers from: every component's state ([`crate::health`]).
    pub health: HealthBoard,
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
        // Every answered Save is indexed (and so offered to the lower tiers) before the
        // demotion worker stops.
        if tokio::time::timeout(drain_timeout, self.engine.settle())
            .await
            .is_err()
        {
            tracing::warn!("seals still pending after {drain_timeout:?}; stopping the lower tiers without them");
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
    tracing::info!(
        version = env!("CARGO_PKG_VERSION"),
        "pegaflow-server starting"
    );
    pipeline.server.validate()?;
    let nofile = raise_open_file_limit();
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
        fd_channel: fd_channel
            .clone()
            .map(|c| c as Arc<dyn crate::plugin::SideChannel>),
        devices: pipeline.server.devices.clone(),
        numa_affinity: pipeline.server.numa_affinity,
        index_events: Default::default(),
        metrics: metrics.registry().clone(),
        health: Default::default(),
    };
    let built = build_pipeline(&pipeline, &ctx, &metrics)?;
    report_components(
        &ctx.health,
        &built,
        fd_channel.as_deref(),
        pipeline.directory.is_some(),
    );
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
            engine.metrics().registry().registry(),
            ctx.health.clone(),
        )
    });

    if directory.is_some() && engine.peer().is_none() {
        tracing::warn!(
            "the [directory] lists this node's blocks, but the pipeline has no [peer]: other nodes cannot fetch them from here (add a [peer] table, --peer-data-addr or --nics)"
        );
    }
    // The peer rung: a [peer] that fetches, with the directory that says from where.
    if let Some(fetcher) = engine.peer().and_then(|p| p.fetcher()) {
        match &directory {
            Some(d) => {
                tracing::info!(peer = fetcher.kind(), "peer fetch on: queries fall through DRAM → peer → lower tiers");
                engine.store().set_peer(fetcher, Arc::new(d.clone()));
            }
            None => tracing::warn!(
                peer = fetcher.kind(),
                "the [peer] can fetch, but the pipeline has no [directory] to find holders with: serving peers only"
            ),
        }
    }

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
    let (grpc_cap, http_cap) = connection_caps(&pipeline, nofile);
    let svc = svc
        .with_admin_allow(pipeline.server.admin_allow.clone())
        .with_save_headers_early(pipeline.server.save_headers_early)
        .with_save_answer_early(pipeline.server.save_answer_early);
    {
        let stop = stop.clone();
        let health = ctx.health.clone();
        health.report("grpc", HealthState::Ok, format!("serving on {grpc_addr}"));
        let listener = CappedListener::new(
            grpc_listener,
            "grpc",
            "[server] max_connections (--max-connections)",
            grpc_cap,
            engine.metrics(),
        );
        let incoming = futures::stream::unfold(listener, |mut l| async move {
            let conn = l.next().await;
            Some((Ok::<_, std::io::Error>(conn), l))
        });
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
                health.report(
                    "grpc",
                    HealthState::Unhealthy,
                    format!("the gRPC server stopped: {e}"),
                );
            }
        }));
    }
    {
        let stop = stop.clone();
        let app = crate::http::router(
            engine.clone(),
            ctx.health.clone(),
            pipeline.server.enable_prometheus,
            pipeline.server.admin_allow.clone(),
        );
        let listener = CappedListener::new(
            http_listener,
            "http",
            "[server] max_http_connections",
            http_cap,
            engine.metrics(),
        );
        tasks.push(tokio::spawn(async move {
            let r = axum::serve(
                listener,
                app.into_make_service_with_connect_info::<PeerAddr>(),
            )
            .with_graceful_shutdown(async move { stop.notified().await })
            .await;
            if let Err(e) = r {
                tracing::error!(error = %e, "HTTP server failed");
            }
        }));
    }
    let side_channel = pipeline
        .fd_channel
        .as_ref()
        .map_or_else(|| "off".to_string(), |c| c.path.display().to_string());
    tracing::info!(%grpc_addr, %http_addr, fd_channel = %side_channel, "serving");
    Ok(ServerHandle {
        grpc_addr,
        http_addr,
        engine,
        fd_channel,
        directory,
        health: ctx.health.clone(),
        stop,
        shutdown_requested,
        tasks,
    })
}

/// The runtime's own lines of `/health?verbose=1`: one per tier (`tier dram`, `tier ssd`), the
/// peer path (`peer tcp`, or `peer` when there is none) and the side channel. A backend's own
/// report of the same name (made while it was built) wins.
fn report_components(
    health: &HealthBoard,
    built: &BuiltPipeline,
    fd_channel: Option<&FdChannel>,
    directory: bool,
) {
    let ok = HealthState::Ok;
    health.report_if_absent(
        &format!("tier {}", built.pool.kind()),
        ok,
        format!(
            "landing tier, capacity_bytes={}",
            built.pool.capacity_bytes()
        ),
    );
    let mut above = built.pool.kind();
    for t in &built.lower {
        health.report_if_absent(&format!("tier {}", t.kind()), ok, format!("below {above}"));
        above = t.kind();
    }
    match &built.peer {
        Some(p) => health.report_if_absent(
            &format!("peer {}", p.kind()),
            ok,
            match (p.fetcher().is_some(), directory) {
                (true, true) => "serves peers and fetches from those the directory names",
                (true, false) => "serves peers; fetches nothing (no [directory] to find holders)",
                (false, _) => "serves peers",
            },
        ),
        None if directory => health.report(
            "peer",
            ok,
            "none: the directory lists this node's blocks, but no peer can fetch them from here",
        ),
        None => health.report("peer", ok, "none"),
    }
    if let Some(c) = fd_channel {
        health.report(
            "fd channel",
            ok,
            format!("listening at {}", c.path().display()),
        );
    }
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
                crate::plugin::wrap_tier(b, &t.layers, metrics.registry())
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
                    crate::plugin::wrap_transport(built, &t.layers, metrics.registry())
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

/// The open-file limit, after raising the soft limit to the hard one (systemd's soft default
/// is 1,024): `None` for unlimited or unknown.
#[derive(Debug, Clone, Copy)]
struct OpenFileLimit {
    soft: Option<u64>,
    hard: Option<u64>,
}

fn raise_open_file_limit() -> OpenFileLimit {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `l` is a valid, writable `rlimit` for the call to fill.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) } != 0 {
        tracing::warn!(error = %std::io::Error::last_os_error(), "cannot read the open-file limit");
        return OpenFileLimit {
            soft: None,
            hard: None,
        };
    }
    if l.rlim_cur < l.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: l.rlim_max,
            rlim_max: l.rlim_max,
        };
        // SAFETY: `raised` is a valid `rlimit`; the call only reads it.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            l.rlim_cur = l.rlim_max;
        } else {
            tracing::warn!(
                soft = l.rlim_cur,
                hard = l.rlim_max,
                error = %std::io::Error::last_os_error(),
                "cannot raise the soft open-file limit to the hard one"
            );
        }
    }
    let finite = |v: libc::rlim_t| (v != libc::RLIM_INFINITY).then_some(v);
    OpenFileLimit {
        soft: finite(l.rlim_cur),
        hard: finite(l.rlim_max),
    }
}

/// Descriptors this process has open (0 when `/proc` cannot tell).
fn open_fd_count() -> u64 {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count() as u64)
}

/// The gRPC and HTTP connection caps: `[server] max_connections` or the one derived from the
/// open-file limit ([`crate::config::default_max_connections`]), and
/// `max_http_connections`. Logs them with the limit; warns when they do not fit in it.
fn connection_caps(pipeline: &PipelineConfig, nofile: OpenFileLimit) -> (usize, usize) {
    let s = &pipeline.server;
    let open = open_fd_count();
    let http = s.max_http_connections;
    let side_channel = match &pipeline.fd_channel {
        Some(_) => {
            let l = FdChannelLimits::default();
            (l.max_connections + l.max_pending) as u64
        }
        None => 0,
    };
    let others = http as u64 + side_channel;
    let grpc = s
        .max_connections
        .unwrap_or_else(|| crate::config::default_max_connections(nofile.soft, open, others));
    let show = |v: Option<u64>| v.map_or_else(|| "unlimited".to_string(), |v| v.to_string());
    tracing::info!(
        nofile_soft = %show(nofile.soft),
        nofile_hard = %show(nofile.hard),
        open_fds = open,
        max_connections = grpc,
        derived = s.max_connections.is_none(),
        max_http_connections = http,
        "connection limits"
    );
    if let Some(soft) = nofile.soft {
        let need = open + grpc as u64 + others;
        if need > soft {
            tracing::warn!(
                nofile_soft = soft,
                needed = need,
                "max_connections + max_http_connections + the side channel + the descriptors open now exceed the open-file limit: under a flood, accepts fail with EMFILE (and back off) before the caps refuse; lower max_connections or raise the limit"
            );
        }
    }
    (grpc, http)
}

/// The first sleep after an accept fails for lack of resources; doubled per failure.
const ACCEPT_BACKOFF_MIN: Duration = Duration::from_millis(10);
/// The longest sleep between failing accepts.
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);
/// At most one "cap reached" line per listener in this time.
const REFUSAL_LOG_EVERY: Duration = Duration::from_secs(10);

/// A TCP listener that holds at most `cap` connections: each accepted [`Conn`] holds one
/// slot until it is dropped; a connection beyond the cap is accepted and closed at once
/// (counted in `pegaflow_connections_refused_total`), so the kernel backlog never fills with
/// connections nobody will serve. An accept that fails for want of descriptors or memory
/// (EMFILE, ENFILE, ENOBUFS, ENOMEM, or anything else not about one connection) sleeps
/// 10 ms, doubling to 1 s, and logs once per burst.
struct CappedListener {
    listener: TcpListener,
    /// The `listener` label and log field.
    name: &'static str,
    /// The setting that sets the cap, for the log.
    setting: &'static str,
    cap: usize,
    slots: Arc<tokio::sync::Semaphore>,
    open: prometheus::IntGauge,
    refused: prometheus::IntCounter,
    unlogged_refusals: u64,
    last_refusal_log: Option<tokio::time::Instant>,
    burst: Option<AcceptBurst>,
}

/// A run of failing accepts: the next sleep, the failures so far, when it began.
struct AcceptBurst {
    delay: Duration,
    errors: u64,
    since: tokio::time::Instant,
}

impl CappedListener {
    fn new(
        listener: TcpListener,
        name: &'static str,
        setting: &'static str,
        cap: usize,
        metrics: &Metrics,
    ) -> Self {
        Self {
            listener,
            name,
            setting,
            cap,
            slots: Arc::new(tokio::sync::Semaphore::new(cap)),
            open: metrics.connections_open.with_label_values(&[name]),
            refused: metrics.connections_refused.with_label_values(&[name]),
            unlogged_refusals: 0,
            last_refusal_log: None,
            burst: None,
        }
    }

    /// The next connection within the cap; never returns an error.
    async fn next(&mut self) -> Conn {
        loop {
            match self.listener.accept().await {
                Ok((stream, peer)) => {
                    self.end_burst();
                    let Ok(permit) = self.slots.clone().try_acquire_owned() else {
                        drop(stream);
                        self.refused.inc();
                        self.log_refusal(peer);
                        continue;
                    };
                    // TCP_NODELAY: without it a small response segment waits for the
                    // client's delayed ACK (~40 ms stalls between RPCs).
                    let _ = stream.set_nodelay(true);
                    // TCP keepalive: a peer whose host died without a FIN or RST would
                    // otherwise hold its slot for ever (gRPC pings stay off for the client).
                    set_keepalive(&stream);
                    self.open.inc();
                    return Conn {
                        stream,
                        peer,
                        _slot: ConnSlot {
                            _permit: permit,
                            open: self.open.clone(),
                        },
                    };
                }
                // About that one connection (it went away before we took it): take the next.
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::ConnectionAborted
                            | std::io::ErrorKind::ConnectionReset
                            | std::io::ErrorKind::ConnectionRefused
                    ) => {}
                Err(e) => self.back_off(e).await,
            }
        }
    }

    fn log_refusal(&mut self, peer: SocketAddr) {
        self.unlogged_refusals += 1;
        let now = tokio::time::Instant::now();
        if self
            .last_refusal_log
            .is_none_or(|t| now.duration_since(t) >= REFUSAL_LOG_EVERY)
        {
            tracing::warn!(
                listener = self.name,
                cap = self.cap,
                refused = self.unlogged_refusals,
                last_peer = %peer,
                "connection cap reached: closing new connections at once (raise {} to hold more)",
                self.setting
            );
            self.unlogged_refusals = 0;
            self.last_refusal_log = Some(now);
        }
    }

    async fn back_off(&mut self, e: std::io::Error) {
        let name = self.name;
        let burst = self.burst.get_or_insert_with(|| {
            tracing::warn!(
                listener = name,
                error = %e,
                "accept failed: backing off (10 ms doubling to 1 s) until an accept succeeds"
            );
            AcceptBurst {
                delay: ACCEPT_BACKOFF_MIN,
                errors: 0,
                since: tokio::time::Instant::now(),
            }
        });
        burst.errors += 1;
        let delay = burst.delay;
        burst.delay = (delay * 2).min(ACCEPT_BACKOFF_MAX);
        tokio::time::sleep(delay).await;
    }

    fn end_burst(&mut self) {
        if let Some(b) = self.burst.take() {
            tracing::info!(
                listener = self.name,
                failed_accepts = b.errors,
                secs = b.since.elapsed().as_secs_f64(),
                "accepting again"
            );
        }
    }
}

impl axum::serve::Listener for CappedListener {
    type Io = Conn;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Conn, SocketAddr) {
        let conn = self.next().await;
        let peer = conn.peer;
        (conn, peer)
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }
}

impl axum::extract::connect_info::Connected<axum::serve::IncomingStream<'_, CappedListener>>
    for PeerAddr
{
    fn connect_info(stream: axum::serve::IncomingStream<'_, CappedListener>) -> Self {
        PeerAddr(*stream.remote_addr())
    }
}

/// A connection's slot under its listener's cap: released (and the gauge lowered) when the
/// connection is dropped.
struct ConnSlot {
    _permit: tokio::sync::OwnedSemaphorePermit,
    open: prometheus::IntGauge,
}

impl Drop for ConnSlot {
    fn drop(&mut self) {
        self.open.dec();
    }
}

/// An accepted TCP connection holding a slot of its listener.
struct Conn {
    stream: tokio::net::TcpStream,
    peer: SocketAddr,
    _slot: ConnSlot,
}

impl tonic::transport::server::Connected for Conn {
    type ConnectInfo = tonic::transport::server::TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        tonic::transport::server::TcpConnectInfo {
            local_addr: self.stream.local_addr().ok(),
            remote_addr: Some(self.peer),
        }
    }
}

impl tokio::io::AsyncRead for Conn {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().stream).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for Conn {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.get_mut().stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.get_mut().stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

/// Enables TCP keepalive on an accepted connection: the first probe after 60 s idle, then
/// every 10 s, the connection dropped after 6 unanswered (a dead peer frees its slot within
/// about two minutes). Best effort: a refused option leaves the connection as it was.
fn set_keepalive(stream: &tokio::net::TcpStream) {
    use nix::sys::socket::{setsockopt, sockopt};
    let _ = setsockopt(stream, sockopt::KeepAlive, &true);
    #[cfg(target_os = "linux")]
    {
        let _ = setsockopt(stream, sockopt::TcpKeepIdle, &60);
        let _ = setsockopt(stream, sockopt::TcpKeepInterval, &10);
        let _ = setsockopt(stream, sockopt::TcpKeepCount, &6);
    }
}
