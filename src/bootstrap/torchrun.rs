//! Rendezvous under torchrun, whose elastic agent already runs torch's own
//! `TCPStore` on `MASTER_PORT` (`TORCHELASTIC_USE_AGENT_STORE=True`).
//!
//! Rank 0 does not bind `MASTER_PORT`: it starts ferrocomm's authenticated
//! store on an ephemeral port and publishes where to find it in torch's
//! store, under
//! `ferrocomm/{TORCHELASTIC_RUN_ID}/attempt_{TORCHELASTIC_RESTART_COUNT}/gen_{g}/store`.
//! The generation `g` keeps a second rendezvous in the same job attempt from
//! reading the first one's address: every rank ADDs 1 to
//! `.../rendezvous_count`, and the `i`-th rendezvous's `world` increments
//! land in `((i-1)·world, i·world]` because each rendezvous ends with a
//! barrier that all ranks pass only after their ADD; so `g = ⌈count/world⌉`
//! is the same on every rank. A restart gets a fresh namespace.
//!
//! What is published:
//! * all ranks on this host (`LOCAL_WORLD_SIZE == WORLD_SIZE`):
//!   `file <path>`, a private rendezvous file holding the address and, when
//!   the launcher set no token, one rank 0 generated (see
//!   [`super::private_file`]);
//! * several hosts: `tcp <ip:port>`; the token must then come from
//!   `FERROCOMM_TOKEN`/`FERROCOMM_TOKEN_FILE`, as there is no private channel
//!   to the other hosts.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::private_file::{private_dir, random_token, read_rendezvous_file, RendezvousFile, RendezvousInfo};
use super::tcp::{TcpStore, TcpStoreConfig, TcpStoreServer};
use super::torch_store::TorchStoreClient;
use super::Store;
use crate::error::{Error, Result};

/// Everything the agent-store rendezvous needs, parsed from the environment.
pub(super) struct AgentStoreJob<'a> {
    /// `MASTER_ADDR:MASTER_PORT` as resolved: torch's store.
    pub master: SocketAddr,
    pub run_id: &'a str,
    pub restart_count: u64,
    pub rank: usize,
    pub world: usize,
    pub local_world: Option<usize>,
    /// `FERROCOMM_STORE_BIND`.
    pub bind: Option<IpAddr>,
    /// From the launcher; `None` asks rank 0 to generate one (one host only).
    pub token: Option<Vec<u8>>,
    pub timeout: Duration,
    pub xdg_runtime_dir: Option<&'a str>,
    pub tmpdir: Option<&'a str>,
}

/// The outcome: a connected ferrocomm store, plus what rank 0 must keep.
pub(super) struct Joined {
    pub store: Arc<dyn Store>,
    pub server: Option<TcpStoreServer>,
    /// Rank 0's rendezvous file; removed once every rank has read it.
    pub file: Option<RendezvousFile>,
}

impl AgentStoreJob<'_> {
    fn all_on_this_host(&self) -> bool {
        self.local_world == Some(self.world)
    }

    fn namespace(&self) -> String {
        format!("ferrocomm/{}/attempt_{}", self.run_id, self.restart_count)
    }
}

pub(super) fn rendezvous(job: &AgentStoreJob<'_>) -> Result<Joined> {
    let start = Instant::now();
    let left = || job.timeout.saturating_sub(start.elapsed());
    if job.token.is_none() && !job.all_on_this_host() {
        return Err(Error::invalid(format!(
            "no store token: this torchrun job spans several hosts (LOCAL_WORLD_SIZE={}, WORLD_SIZE={}), \
             and ferrocomm can only hand a generated token to ranks on its own host; set FERROCOMM_TOKEN \
             to a per-job random secret on every host (e.g. `export FERROCOMM_TOKEN=$(openssl rand -hex 32)`), \
             or FERROCOMM_TOKEN_FILE to a mode-0600 file holding it",
            job.local_world.map_or_else(|| "unset".to_string(), |n| n.to_string()),
            job.world
        )));
    }
    let torch = TorchStoreClient::connect(job.master, job.timeout).map_err(|e| {
        Error::Store(format!(
            "rank {}: cannot use torchrun's agent store at MASTER_ADDR:MASTER_PORT ({}): {e}. torchrun runs \
             one there when TORCHELASTIC_USE_AGENT_STORE=True; FERROCOMM_STORE_TIMEOUT_S bounds this wait",
            job.rank, job.master
        ))
    })?;
    let ns = job.namespace();
    let count = torch.add(&format!("{ns}/rendezvous_count"), 1)?;
    let generation = generation(count, job.world)?;
    let key = format!("{ns}/gen_{generation}/store");

    if job.rank == 0 {
        host(job, &torch, &key, left())
    } else {
        join(job, &torch, &key, left())
    }
}

/// `⌈count/world⌉`: the same on every rank of one rendezvous (module docs).
fn generation(count: i64, world: usize) -> Result<i64> {
    let world = i64::try_from(world).map_err(|_| Error::invalid("WORLD_SIZE is too large"))?;
    if count < 1 {
        return Err(Error::Store(format!(
            "ferrocomm's rendezvous counter in torch's store is {count}; something else wrote it"
        )));
    }
    Ok((count - 1) / world + 1)
}

/// Rank 0: start the store, publish where it is, connect to it.
fn host(job: &AgentStoreJob<'_>, torch: &TorchStoreClient, key: &str, left: Duration) -> Result<Joined> {
    let start = Instant::now();
    let local = job.all_on_this_host();
    let generated = match job.token {
        Some(_) => None,
        None => Some(random_token()?),
    };
    let token = job
        .token
        .clone()
        .or_else(|| generated.clone().map(String::into_bytes))
        .unwrap_or_default();
    let bind_ip = match job.bind {
        Some(ip) => ip,
        None if local => IpAddr::V4(Ipv4Addr::LOCALHOST),
        None => reachable_ip(job.master)?,
    };
    let server = TcpStoreServer::start(TcpStoreConfig {
        bind_addr: bind_ip,
        port: 0,
        token: token.clone(),
        connect_timeout: job.timeout,
        ..TcpStoreConfig::default()
    })
    .map_err(|e| match e {
        Error::Io { context, source } => Error::io(
            format!("{context} (rank 0's store under torchrun; FERROCOMM_STORE_BIND sets the address)"),
            source,
        ),
        other => other,
    })?;
    let advertised = match server.local_addr() {
        a if !a.ip().is_unspecified() => a,
        a if local => SocketAddr::new(server.connect_addr().ip(), a.port()),
        a => SocketAddr::new(reachable_ip(job.master)?, a.port()),
    };
    let (published, file) = if local {
        let dir = private_dir(job.xdg_runtime_dir, job.tmpdir)?;
        let info = RendezvousInfo {
            key: key.to_string(),
            addr: advertised,
            token: generated,
        };
        let file = RendezvousFile::create(&dir, &info)?;
        (format!("file {}", file.path().display()), Some(file))
    } else {
        (format!("tcp {advertised}"), None)
    };
    torch.set(key, published.as_bytes())?;
    let store = TcpStore::connect(server.connect_addr(), &token, left.saturating_sub(start.elapsed()))?;
    Ok(Joined {
        store: Arc::new(store),
        server: Some(server),
        file,
    })
}

/// Ranks other than 0: find rank 0's store through torch's and connect.
fn join(job: &AgentStoreJob<'_>, torch: &TorchStoreClient, key: &str, left: Duration) -> Result<Joined> {
    let start = Instant::now();
    let published = torch.get(key, left).map_err(|e| match e {
        Error::Timeout { after, .. } => Error::Timeout {
            what: format!("rank 0 to publish its store in torchrun's store (key '{key}')"),
            after,
            missing: vec![0],
        },
        other => other,
    })?;
    let published = String::from_utf8(published)
        .map_err(|_| Error::Store(format!("torch store key '{key}' does not hold text")))?;
    let (addr, token) = match published.split_once(' ') {
        Some(("file", path)) => {
            let info = read_rendezvous_file(Path::new(path), key)?;
            let token = job.token.clone().or(info.token.map(String::into_bytes));
            (info.addr, token)
        }
        Some(("tcp", addr)) => {
            let addr = addr
                .parse()
                .map_err(|_| Error::Store(format!("torch store key '{key}' holds a bad address '{addr}'")))?;
            (addr, job.token.clone())
        }
        _ => {
            // Anyone can write torch's store: show a bounded excerpt only.
            let excerpt: String = published.chars().take(80).collect();
            return Err(Error::Store(format!(
                "torch store key '{key}' holds '{excerpt}', which ferrocomm did not write"
            )));
        }
    };
    let token = token.ok_or_else(|| {
        Error::invalid(
            "no store token: rank 0 published no token for this host; set FERROCOMM_TOKEN (the same on \
             every rank)",
        )
    })?;
    let store = TcpStore::connect(addr, &token, left.saturating_sub(start.elapsed()))?;
    Ok(Joined {
        store: Arc::new(store),
        server: None,
        file: None,
    })
}

/// This host's address on the route to `master` (the kernel's choice of
/// source address; a UDP `connect` sends nothing). Ranks on other hosts reach
/// `master`, so they can most likely reach this address too.
fn reachable_ip(master: SocketAddr) -> Result<IpAddr> {
    let any = if master.is_ipv4() {
        IpAddr::V4(Ipv4Addr::UNSPECIFIED)
    } else {
        IpAddr::V6(Ipv6Addr::UNSPECIFIED)
    };
    let probe = UdpSocket::bind(SocketAddr::new(any, 0))
        .and_then(|s| s.connect(master).and_then(|()| s.local_addr()))
        .map_err(|e| {
            Error::io(
                format!("finding this host's address on the route to MASTER_ADDR ({master})"),
                e,
            )
        })?;
    let ip = probe.ip();
    if ip.is_loopback() || ip.is_unspecified() {
        return Err(Error::invalid(format!(
            "cannot tell which address ranks on other hosts reach rank 0 on: MASTER_ADDR ({}) is this \
             host's loopback; set FERROCOMM_STORE_BIND to this host's address on the cluster network",
            master.ip()
        )));
    }
    Ok(ip)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generations_agree_within_a_rendezvous() {
        let world = 4;
        // Rendezvous 1 takes counts 1..=4, rendezvous 2 takes 5..=8.
        for count in 1..=4 {
            assert_eq!(generation(count, world).expect("gen"), 1);
        }
        for count in 5..=8 {
            assert_eq!(generation(count, world).expect("gen"), 2);
        }
        assert!(generation(0, world).is_err());
    }

    #[test]
    fn loopback_master_cannot_tell_other_hosts_where_to_go() {
        let err = reachable_ip("127.0.0.1:29500".parse().expect("addr")).expect_err("loopback");
        assert!(err.to_string().contains("FERROCOMM_STORE_BIND"), "{err}");
    }
}
