//! Helpers shared by the MetaServer's integration tests: start a MetaServer binary (ours or
//! PegaFlow's) on free ports, kill it when the guard drops, talk HTTP to it.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use pegaflow_proto::meta_server_client::MetaServerClient;
use tonic::transport::Channel;

/// Our binary.
pub fn our_binary() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_pegaflow-metaserver"))
}

/// PegaFlow's `pegaflow-metaserver-py`: `$PEGAFLOW_PY_METASERVER`, else the one in the
/// workspace's `.venv` (`scripts/python-venv.sh` installs it).
pub fn pegaflow_binary() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("PEGAFLOW_PY_METASERVER") {
        let p = PathBuf::from(p);
        return p.is_file().then_some(p);
    }
    let lib = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv/lib");
    let mut found: Vec<PathBuf> = std::fs::read_dir(lib)
        .ok()?
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
        .map(|e| {
            e.path()
                .join("site-packages/pegaflow/pegaflow-metaserver-py")
        })
        .filter(|p| p.is_file())
        .collect();
    found.sort();
    found.pop()
}

/// A port nobody listens on right now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// Whether a server's log says it could not bind because the address is taken (`Address
/// already in use (os error 98)`, `[Errno 98]`).
fn addr_in_use(log: &str) -> bool {
    let log = log.to_ascii_lowercase();
    [
        "address already in use",
        "address in use",
        "os error 98",
        "errno 98",
    ]
    .iter()
    .any(|m| log.contains(m))
}

/// A MetaServer process, killed (SIGKILL) and reaped when dropped unless stopped first.
pub struct Server {
    child: Option<Child>,
    /// `127.0.0.1:<port>` of its gRPC service.
    pub grpc: String,
    /// `127.0.0.1:<port>` of its HTTP endpoints.
    pub http: String,
    /// Where its stdout and stderr go.
    pub log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Server {
    /// Starts `bin` with `--addr`/`--http-addr` on free loopback ports and `args`, and waits
    /// until both ports accept connections (panics with the log if it exits or takes 20 s).
    pub fn start(bin: &Path, args: &[&str]) -> Server {
        Self::start_with_env(bin, args, &[])
    }

    /// As [`Server::start`], with extra environment variables.
    ///
    /// A port [`free_port`] handed out can be taken by another process before the server
    /// binds it (tests run in parallel, and two servers of one test pick their ports before
    /// either binds): an exit at start whose log says the address is in use is retried on
    /// fresh ports, at most 5 times.
    pub fn start_with_env(bin: &Path, args: &[&str], env: &[(&str, &str)]) -> Server {
        for attempt in 1.. {
            let mut s = Self::spawn(bin, args, env);
            match s.wait_ready() {
                Ok(()) => return s,
                Err(why) if attempt < 5 && addr_in_use(&s.log_text()) => {
                    eprintln!("{}: {why}; retrying on fresh ports", bin.display());
                }
                Err(why) => panic!("{why}:\n{}", s.log_text()),
            }
        }
        unreachable!()
    }

    fn spawn(bin: &Path, args: &[&str], env: &[(&str, &str)]) -> Server {
        let dir = tempfile::tempdir().expect("temp dir");
        let log = dir.path().join("server.log");
        let grpc = format!("127.0.0.1:{}", free_port());
        let http = format!("127.0.0.1:{}", free_port());
        let out = std::fs::File::create(&log).expect("log file");
        let err = out.try_clone().expect("log file");
        let mut cmd = Command::new(bin);
        cmd.arg("--addr")
            .arg(&grpc)
            .arg("--http-addr")
            .arg(&http)
            .args(args)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {}: {e}", bin.display()));
        Server {
            child: Some(child),
            grpc,
            http,
            log,
            _dir: dir,
        }
    }

    /// Waits until both ports accept connections; `Err` if the process exited first
    /// (reaped); panics with the log after 20 s.
    fn wait_ready(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                self.child = None;
                return Err(format!("{} exited with {status} at start", self.grpc));
            }
            if TcpStream::connect(&self.grpc).is_ok() && TcpStream::connect(&self.http).is_ok() {
                return Ok(());
            }
            assert!(
                Instant::now() < deadline,
                "server not ready after 20 s:\n{}",
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Its output so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// A gRPC client.
    pub async fn client(&self) -> MetaServerClient<Channel> {
        MetaServerClient::connect(format!("http://{}", self.grpc))
            .await
            .expect("connect to the MetaServer")
    }

    /// Sends SIGTERM and waits (at most `within`) for the exit status.
    pub fn terminate(&mut self, within: Duration) -> std::process::ExitStatus {
        self.signal(nix::sys::signal::Signal::SIGTERM, within)
    }

    /// Sends `sig` and waits (at most `within`) for the exit status.
    pub fn signal(
        &mut self,
        sig: nix::sys::signal::Signal,
        within: Duration,
    ) -> std::process::ExitStatus {
        let child = self.child.as_mut().expect("running");
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(child.id() as i32), sig)
            .expect("send the signal");
        let deadline = Instant::now() + within;
        loop {
            if let Some(s) = child.try_wait().expect("wait") {
                self.child = None;
                return s;
            }
            assert!(
                Instant::now() < deadline,
                "no exit within {within:?} of SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// `GET path` on `addr`: (status code, body).
pub fn http_get(addr: &str, path: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).expect("connect HTTP");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).expect("read HTTP response");
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(body)
    } else {
        body.to_string()
    };
    (code, body)
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((len, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(len.trim(), 16).unwrap_or(0);
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        s = rest[n..].trim_start_matches("\r\n");
    }
    out
}

/// The samples of a Prometheus text exposition whose name starts with `prefix`: `(name,
/// labels sorted, without PegaFlow's OpenTelemetry `otel_scope_name`) → value`.
pub fn samples(text: &str, prefix: &str) -> std::collections::BTreeMap<(String, String), f64> {
    let mut out = std::collections::BTreeMap::new();
    for line in text.lines() {
        if line.starts_with('#') || !line.starts_with(prefix) {
            continue;
        }
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let (name, labels) = match series.split_once('{') {
            Some((n, l)) => (n, l.trim_end_matches('}')),
            None => (series, ""),
        };
        let mut ls: Vec<&str> = split_labels(labels)
            .into_iter()
            .filter(|l| !l.starts_with("otel_scope_name="))
            .collect();
        ls.sort();
        out.insert(
            (name.to_string(), ls.join(",")),
            value.parse().unwrap_or(f64::NAN),
        );
    }
    out
}

/// Splits `a="x",b="y, z"` at the commas between labels.
fn split_labels(s: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let (mut start, mut quoted, mut escaped) = (0, false, false);
    for (i, c) in s.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' => escaped = true,
            '"' => quoted = !quoted,
            ',' if !quoted => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if start < s.len() {
        out.push(&s[start..]);
    }
    out
}
