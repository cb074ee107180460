//! `pegaflow-wake-probe`: how long a client takes to see a Save's answer once the server has
//! held the call for `--hold-us`, with the response headers sent either with the answer
//! (`--lead-us 0`) or that many µs before it. Answers every Save `ok`; nothing else is served.
//! The handler polls the clock on its own task (yielding), so the server side stays awake and
//! the figure is the client's own wake-up. Drive it with `bench/gpu/wake_probe.py`.
use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::time::{Duration, Instant};

use clap::Parser;
use pegaflow_proto as pb;
use tonic::codegen::{http, Body, BoxFuture, Context, Poll, Service, StdError};
use tonic::{Request, Response, Status};

#[derive(Parser, Debug, Clone, Copy)]
struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:50055")]
    listen: SocketAddr,
    /// How long each Save is held before its answer, µs.
    #[arg(long, default_value_t = 10_000)]
    hold_us: u64,
    /// How long before the answer the response headers go out, µs (0: with the answer).
    #[arg(long, default_value_t = 0)]
    lead_us: u64,
    /// Answer every Save with an INTERNAL status (in the trailers, after the headers) instead
    /// of `ok`: how the client takes a Save that fails after its headers.
    #[arg(long)]
    answer_error: bool,
}

async fn until(t: Instant) {
    while Instant::now() < t {
        tokio::task::yield_now().await;
    }
}

#[derive(Clone, Copy)]
struct SaveSvc(Args);

type Answer = Pin<Box<dyn futures::Stream<Item = Result<pb::SaveResponse, Status>> + Send>>;

impl tonic::server::ServerStreamingService<pb::SaveRequest> for SaveSvc {
    type Response = pb::SaveResponse;
    type ResponseStream = Answer;
    type Future = BoxFuture<Response<Answer>, Status>;

    fn call(&mut self, _req: Request<pb::SaveRequest>) -> Self::Future {
        let a = self.0;
        Box::pin(async move {
            let t0 = Instant::now();
            let end = t0 + Duration::from_micros(a.hold_us);
            until(end - Duration::from_micros(a.lead_us.min(a.hold_us))).await;
            let answer = answer_at(end, a.answer_error);
            Ok(Response::new(answer))
        })
    }
}

/// The one answer, at `end`: `ok`, or an INTERNAL status when `error`.
fn answer_at(end: Instant, error: bool) -> Answer {
    Box::pin(futures::stream::once(async move {
        until(end).await;
        if error {
            return Err(Status::internal("wake probe: the copy failed"));
        }
        Ok(pb::SaveResponse {
            status: Some(pb::ResponseStatus {
                ok: true,
                message: String::new(),
            }),
        })
    }))
}

#[derive(Clone, Copy)]
struct Probe(Args);

impl tonic::server::NamedService for Probe {
    const NAME: &'static str = "pegaflow.Engine";
}

impl<B> Service<http::Request<B>> for Probe
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
        let a = self.0;
        Box::pin(async move {
            if req.uri().path() != "/pegaflow.Engine/Save" {
                return Ok(Status::unimplemented("only Save").into_http());
            }
            let codec = tonic_prost::ProstCodec::<pb::SaveResponse, pb::SaveRequest>::default();
            let mut grpc = tonic::server::Grpc::new(codec);
            Ok(grpc.server_streaming(SaveSvc(a), req).await)
        })
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    eprintln!(
        "wake probe on {} (hold {} µs, headers {} µs early)",
        a.listen, a.hold_us, a.lead_us
    );
    tonic::transport::Server::builder()
        .add_service(Probe(a))
        .serve(a.listen)
        .await?;
    Ok(())
}
