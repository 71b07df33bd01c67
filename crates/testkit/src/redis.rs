//! Debian's `redis-server` for tests: started on a free loopback port
//! without persistence, killed when dropped, and a raw RESP command for a
//! test to read or damage what a server holds.
//!
//! Invariants: every server binds 127.0.0.1 only; every wait is bounded;
//! without `redis-server` installed, [`have_redis`] prints `skipped: ...`
//! and the caller returns without checking anything.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Whether `redis-server` runs here; prints `skipped: ...` when not.
pub fn have_redis() -> bool {
    let found = Command::new("redis-server")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok();
    if !found {
        println!("skipped: redis-server not installed");
    }
    found
}

/// A port nothing listens on now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .expect("binding a loopback port")
        .local_addr()
        .expect("a bound address")
        .port()
}

/// A `redis-server` on a loopback port, without persistence.
pub struct RedisServer {
    child: Option<Child>,
    /// Its port.
    pub port: u16,
}

impl RedisServer {
    /// A server on a free port (retrying a few ports if one is taken
    /// meanwhile).
    pub fn start_free() -> RedisServer {
        for _ in 0..5 {
            if let Some(s) = Self::start(free_port()) {
                return s;
            }
        }
        panic!("could not start redis-server on a free loopback port");
    }

    /// A server on `port` (empty), once it answers PING; `None` when it
    /// exits first (the port was taken).
    pub fn start(port: u16) -> Option<RedisServer> {
        let child = Command::new("redis-server")
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .ok()?;
        let mut s = RedisServer {
            child: Some(child),
            port,
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if s.command(&[b"PING"]).is_ok_and(|r| r.starts_with(b"+PONG")) {
                return Some(s);
            }
            if let Some(c) = s.child.as_mut()
                && c.try_wait().ok().flatten().is_some()
            {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("redis-server on port {port} did not answer PING within 10 s");
    }

    /// `redis://127.0.0.1:PORT/0`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    /// Kill the server and wait for it to exit.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Send one command (its arguments as bulk strings) and return the raw
    /// reply bytes (one read, up to 64 KiB, within 2 s).
    pub fn command(&self, args: &[&[u8]]) -> std::io::Result<Vec<u8>> {
        let mut c = TcpStream::connect(("127.0.0.1", self.port))?;
        c.set_read_timeout(Some(Duration::from_secs(2)))?;
        let mut req = format!("*{}\r\n", args.len()).into_bytes();
        for a in args {
            req.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
            req.extend_from_slice(a);
            req.extend_from_slice(b"\r\n");
        }
        c.write_all(&req)?;
        let mut buf = vec![0u8; 64 * 1024];
        let n = c.read(&mut buf)?;
        buf.truncate(n);
        Ok(buf)
    }

    /// An integer field of `INFO stats` (e.g. `keyspace_hits`), 0 when
    /// the server does not answer.
    pub fn info_stat(&self, field: &str) -> u64 {
        let Ok(r) = self.command(&[b"INFO", b"stats"]) else {
            return 0;
        };
        String::from_utf8_lossy(&r)
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{field}:")))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}
