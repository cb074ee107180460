//! The `pegaflow.MetaServer` gRPC service as tonic serves it: routes each method's path to
//! [`MetaService::handle`] through the pass-through codec ([`crate::codec`]), with the
//! protocol's 64 MiB message limit; any other path answers UNIMPLEMENTED (PegaFlow's
//! `PullBackupPlan` included), as a generated server does.
//!
//! A request body tonic itself cannot take apart (no message at all, a frame cut short, a
//! compression flag with no encoding) never reaches the service: tonic answers INTERNAL,
//! which is rewritten here to INVALID_ARGUMENT `undecodable <method> request: ...` and
//! counted like a body that does not decode. Statuses tonic answers before the service ran
//! are counted in `pegaflow_metaserver_rpc_requests_total` here.

use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use prost::bytes::Bytes;
use tonic::codegen::{http, Body, BoxFuture, Context, Poll, Service, StdError};
use tonic::server::{NamedService, UnaryService};
use tonic::{Request, Response, Status};

use crate::codec::RawCodec;
use crate::service::{MetaService, Method};

/// How tonic's INTERNAL statuses for a request body it cannot take apart begin.
const BODY_ERRORS: [&str; 3] = [
    "Missing request message",
    "Unexpected EOF decoding stream",
    "protocol error: received message with",
];

/// The trailers-only status headers.
const GRPC_STATUS: http::HeaderName = http::HeaderName::from_static("grpc-status");
const GRPC_MESSAGE: http::HeaderName = http::HeaderName::from_static("grpc-message");
const GRPC_STATUS_DETAILS: http::HeaderName =
    http::HeaderName::from_static("grpc-status-details-bin");

/// The service for tonic's router.
#[derive(Clone)]
pub struct MetaServerRouter {
    svc: Arc<MetaService>,
}

impl MetaServerRouter {
    /// Serves `svc`.
    pub fn new(svc: Arc<MetaService>) -> Self {
        Self { svc }
    }
}

impl NamedService for MetaServerRouter {
    const NAME: &'static str = "pegaflow.MetaServer";
}

/// One method's handler; notes that it ran.
struct Handler {
    svc: Arc<MetaService>,
    method: Method,
    ran: Arc<AtomicBool>,
}

impl UnaryService<Bytes> for Handler {
    type Response = Bytes;
    type Future = BoxFuture<Response<Bytes>, Status>;

    fn call(&mut self, request: Request<Bytes>) -> Self::Future {
        self.ran.store(true, Ordering::Relaxed);
        let (svc, method) = (self.svc.clone(), self.method);
        Box::pin(async move {
            let peer = request.remote_addr();
            svc.handle(method, request.into_inner(), peer)
                .await
                .map(Response::new)
        })
    }
}

impl<B> Service<http::Request<B>> for MetaServerRouter
where
    B: Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let Some(method) = Method::from_path(req.uri().path()) else {
            return Box::pin(async {
                let mut r = http::Response::new(tonic::body::Body::default());
                let h = r.headers_mut();
                h.insert(
                    Status::GRPC_STATUS,
                    (tonic::Code::Unimplemented as i32).into(),
                );
                h.insert(
                    http::header::CONTENT_TYPE,
                    tonic::metadata::GRPC_CONTENT_TYPE,
                );
                Ok(r)
            });
        };
        let svc = self.svc.clone();
        Box::pin(async move {
            let t0 = Instant::now();
            let ran = Arc::new(AtomicBool::new(false));
            let handler = Handler {
                svc: svc.clone(),
                method,
                ran: ran.clone(),
            };
            let mut grpc = tonic::server::Grpc::new(RawCodec).apply_max_message_size_config(
                Some(pegaflow_proto::MAX_MESSAGE_BYTES),
                Some(pegaflow_proto::MAX_MESSAGE_BYTES),
            );
            let mut resp = grpc.unary(handler, req).await;
            if !ran.load(Ordering::Relaxed) {
                before_the_service(&svc, method, t0, &mut resp);
            }
            Ok(resp)
        })
    }
}

/// Counts a status tonic answered before the service ran, rewriting its INTERNAL for a body
/// it could not take apart to INVALID_ARGUMENT.
fn before_the_service(
    svc: &MetaService,
    method: Method,
    t0: Instant,
    resp: &mut http::Response<tonic::body::Body>,
) {
    let Some(status) = Status::from_header_map(resp.headers()) else {
        return;
    };
    let undecodable = status.code() == tonic::Code::Internal
        && BODY_ERRORS.iter().any(|p| status.message().starts_with(p));
    if !undecodable {
        svc.refused_before(method, &status, t0.elapsed(), false);
        return;
    }
    let status = Status::invalid_argument(format!(
        "undecodable {} request: {}",
        method.label(),
        status.message()
    ));
    svc.refused_before(method, &status, t0.elapsed(), true);
    let headers = resp.headers_mut();
    headers.remove(GRPC_STATUS);
    headers.remove(GRPC_MESSAGE);
    headers.remove(GRPC_STATUS_DETAILS);
    if let Err(e) = status.add_header(headers) {
        tracing::warn!(error = %e, "cannot rewrite a status");
    }
}
