//! A real `redis-server` process for tests: started on a free loopback port in a temporary
//! directory, stopped (SIGSTOP) and continued, killed and restarted on the same port, flushed;
//! killed when dropped.
//!
//! Tests that need it call [`RedisServer::start`], which answers `None` (after reporting the
//! test skipped, [`crate::skip!`]) where `redis-server` is not installed; `.ci/run` installs it.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running (or stopped) `redis-server`.
pub struct RedisServer {
    child: Option<Child>,
    port: u16,
    dir: tempfile::TempDir,
    bin: PathBuf,
}

impl std::fmt::Debug for RedisServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisServer")
            .field("port", &self.port)
            .finish()
    }
}

/// `redis-server` on `PATH` (or `$REDIS_SERVER`), if any.
pub fn redis_server_bin() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("REDIS_SERVER") {
        return Some(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join("redis-server"))
        .find(|p| p.is_file())
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

impl RedisServer {
    /// Starts a server with persistence off, or reports `test` skipped ([`crate::skip!`]) and
    /// answers `None` when `redis-server` is not installed.
    ///
    /// # Panics
    /// When the installed server does not start or answer PING within 10 s.
    pub fn start(test: &str) -> Option<Self> {
        let Some(bin) = redis_server_bin() else {
            crate::skip!("{test}: redis-server is not installed (apt-get install redis-server)");
            return None;
        };
        let mut s = Self {
            child: None,
            port: free_port(),
            dir: tempfile::tempdir().expect("tempdir"),
            bin,
        };
        s.spawn();
        Some(s)
    }

    fn spawn(&mut self) {
        let child = Command::new(&self.bin)
            .args([
                "--port",
                &self.port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--protected-mode",
                "no",
                "--dir",
            ])
            .arg(self.dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn redis-server");
        self.child = Some(child);
        let end = Instant::now() + Duration::from_secs(10);
        loop {
            if self
                .try_command(&["PING"])
                .is_ok_and(|r| r.contains("PONG"))
            {
                return;
            }
            assert!(
                Instant::now() < end,
                "redis-server did not answer PING in 10 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `redis://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The server's pid (while it runs).
    pub fn pid(&self) -> Option<i32> {
        self.child.as_ref().map(|c| c.id() as i32)
    }

    fn signal(&self, sig: nix::sys::signal::Signal) {
        if let Some(pid) = self.pid() {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), sig);
        }
    }

    /// Freezes the server (SIGSTOP): connections stay open, nothing answers.
    pub fn freeze(&self) {
        self.signal(nix::sys::signal::Signal::SIGSTOP);
    }

    /// Continues a frozen server (SIGCONT).
    pub fn thaw(&self) {
        self.signal(nix::sys::signal::Signal::SIGCONT);
    }

    /// Kills the server (its data is gone: persistence is off).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            // A frozen process dies on SIGKILL too.
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Kills the server and starts a new one on the same port and directory: empty, unless a
    /// `SAVE` wrote `dump.rdb` there before (persistence is otherwise off).
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// Runs one command (RESP over a plain socket) and returns the raw reply.
    ///
    /// # Errors
    /// The server cannot be reached or does not answer within 2 s.
    pub fn try_command(&self, args: &[&str]) -> std::io::Result<String> {
        let mut s = TcpStream::connect(("127.0.0.1", self.port))?;
        s.set_read_timeout(Some(Duration::from_secs(2)))?;
        let mut req = format!("*{}\r\n", args.len());
        for a in args {
            req.push_str(&format!("${}\r\n{a}\r\n", a.len()));
        }
        s.write_all(req.as_bytes())?;
        let mut buf = vec![0u8; 64 << 10];
        let n = s.read(&mut buf)?;
        Ok(String::from_utf8_lossy(&buf[..n]).into_owned())
    }

    /// Runs one command, panicking when it cannot.
    pub fn command(&self, args: &[&str]) -> String {
        self.try_command(args)
            .unwrap_or_else(|e| panic!("redis {args:?}: {e}"))
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.thaw();
        self.kill();
    }
}
