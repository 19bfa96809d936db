//! Rendezvous from the usual launcher variables (torchrun, mpirun wrappers,
//! Slurm scripts): rank 0 runs the TCP store, every rank connects to it.
//!
//! Variables: `MASTER_ADDR` (default 127.0.0.1), `MASTER_PORT` (required),
//! `RANK`, `WORLD_SIZE`, `LOCAL_RANK` (default `RANK`), `LOCAL_WORLD_SIZE`
//! (optional), and the job token in `FERROCOMM_TOKEN` or in a mode-0600 file
//! named by `FERROCOMM_TOKEN_FILE`. `FERROCOMM_STORE_BIND` overrides the
//! address rank 0 listens on (e.g. `0.0.0.0`); `FERROCOMM_STORE_TIMEOUT_S`
//! the connect/arrival timeout.
//!
//! Under torchrun with its agent store (`TORCHELASTIC_USE_AGENT_STORE=True`,
//! or `TORCHELASTIC_RUN_ID` set without it), torch's own store already holds
//! `MASTER_PORT`; rank 0 then starts ferrocomm's store on an ephemeral port
//! and publishes it through torch's (see [`super::torchrun`]), and on one host
//! the token may be left unset. `docs/bootstrap.md` has the whole design.

use std::fs::File;
use std::io::Read;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::collect::{store_barrier, store_depart};
use super::tcp::{TcpStore, TcpStoreConfig, TcpStoreServer};
use super::torchrun::{self, AgentStoreJob};
use super::Store;
use crate::error::{Error, Result};

/// How long ranks wait for the server and for each other by default. Generous
/// because launchers start ranks on different hosts at different times.
pub const DEFAULT_RENDEZVOUS_TIMEOUT: Duration = Duration::from_secs(300);

/// Longest `TORCHELASTIC_RUN_ID` accepted; it becomes part of store keys.
const MAX_RUN_ID_BYTES: usize = 256;

/// Which launcher started this rank, as told by its variables.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Launcher {
    /// Variables set by hand or by an mpirun/Slurm wrapper (or [`rendezvous`]
    /// called directly): rank 0 binds `MASTER_PORT`.
    Plain,
    /// torchrun. With `agent_store`, torch's store holds `MASTER_PORT` and
    /// ferrocomm finds its own store through it; without, it is handled like
    /// [`Launcher::Plain`].
    Torchrun {
        /// Whether torch's agent store serves the job
        /// (`TORCHELASTIC_USE_AGENT_STORE`; assumed when only
        /// `TORCHELASTIC_RUN_ID` is set).
        agent_store: bool,
    },
}

/// The result of a rendezvous: a connected store and this rank's place.
pub struct EnvRendezvous {
    /// The job's store, connected (rank 0 also serves it).
    pub store: Arc<dyn Store>,
    /// This rank (`RANK`).
    pub rank: usize,
    /// Ranks in the job (`WORLD_SIZE`).
    pub world: usize,
    /// This rank's index on its host (`LOCAL_RANK`, else the rank): the
    /// device ordinal to open.
    pub local_rank: usize,
    /// Ranks on this host (`LOCAL_WORLD_SIZE`), when the launcher says.
    pub local_world: Option<usize>,
    /// Who started the job.
    pub launcher: Launcher,
    /// Rank 0 owns the server; it lives as long as this value.
    server: Option<TcpStoreServer>,
    /// How long rank 0's [`EnvRendezvous::depart`] waits for the others.
    linger: Duration,
    departed: AtomicBool,
}

/// The most rank 0's [`EnvRendezvous::depart`] waits for the others.
pub const DEPART_WAIT_MAX: Duration = Duration::from_secs(60);

/// Where a rank marks that it has left the store (`/<rank>` appended).
const DEPARTED_KEY: &str = "ferrocomm/departed";

impl EnvRendezvous {
    /// Whether this rank hosts the store server (and must outlive the others' use of it).
    pub fn hosts_server(&self) -> bool {
        self.server.is_some()
    }

    /// Leave the store, once this rank has made its last request to it (its
    /// communicators finalized). Every rank but 0 marks that it has left and
    /// returns at once; rank 0, which hosts the store, waits until every
    /// other rank has, for up to the rendezvous timeout (at most
    /// `DEPART_WAIT_MAX`, 60 s), then returns, and the store closes when this
    /// value drops. Without it a rank still using the store when rank 0
    /// exits finds it closed: the last rank out of a store barrier deletes
    /// its keys after the others have gone on (`store closed the
    /// connection`, seen once in CI). Dropping without departing does not
    /// wait. A second call returns at once.
    ///
    /// Rank 0 returns [`Error::Timeout`] naming the ranks that never left.
    pub fn depart(&self) -> Result<()> {
        self.depart_within(self.linger)
    }

    /// [`EnvRendezvous::depart`], rank 0 waiting for at most `wait` (and
    /// never longer than `depart` would): the Python package bounds it by
    /// the communicator's timeout, so that a job whose rank died does not
    /// hold rank 0's exit for a minute.
    pub fn depart_within(&self, wait: Duration) -> Result<()> {
        if self.departed.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        // Rank 0 hosts the store (both rendezvous paths).
        store_depart(
            &*self.store,
            DEPARTED_KEY,
            self.rank,
            self.world,
            0,
            self.linger.min(wait),
        )
    }
}

impl std::fmt::Debug for EnvRendezvous {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EnvRendezvous")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("local_rank", &self.local_rank)
            .field("local_world", &self.local_world)
            .field("launcher", &self.launcher)
            .field("server", &self.server.as_ref().map(|s| s.local_addr()))
            .finish_non_exhaustive()
    }
}

/// Rendezvous using the launcher's environment variables (see the module docs).
pub fn rendezvous_from_env() -> Result<EnvRendezvous> {
    let vars = EnvVars::parse(|name| match std::env::var(name) {
        Ok(v) => Ok(Some(v)),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(_)) => Err(Error::invalid(format!("{name} is not valid UTF-8"))),
    })?;
    rendezvous_with(&vars)
}

/// Like [`rendezvous_from_env`], reading each variable through `lookup`
/// instead of the process environment: for launchers that build a rank's
/// environment themselves, and for tests that run ranks as threads.
pub fn rendezvous_from_vars(lookup: impl Fn(&str) -> Option<String>) -> Result<EnvRendezvous> {
    rendezvous_with(&EnvVars::parse(|name| Ok(lookup(name)))?)
}

fn rendezvous_with(vars: &EnvVars) -> Result<EnvRendezvous> {
    let ranks = Ranks {
        rank: vars.rank,
        world: vars.world,
        local_rank: vars.local_rank,
    };
    check_ranks(&ranks)?;
    let token = vars.token.as_ref().map(TokenSource::load).transpose()?;
    let Some(agent) = &vars.agent_store else {
        let token = token.ok_or_else(missing_token)?;
        let mut rdv = rendezvous_inner(&vars.master_addr, vars.port, vars.bind, ranks, &token, vars.timeout)?;
        rdv.local_world = vars.local_world;
        rdv.launcher = vars.launcher;
        return Ok(rdv);
    };
    let job = AgentStoreJob {
        master: resolve(&vars.master_addr, vars.port)?,
        run_id: &agent.run_id,
        restart_count: agent.restart_count,
        rank: vars.rank,
        world: vars.world,
        local_world: vars.local_world,
        bind: vars.bind,
        token,
        timeout: vars.timeout,
        xdg_runtime_dir: agent.xdg_runtime_dir.as_deref(),
        tmpdir: agent.tmpdir.as_deref(),
    };
    let joined = torchrun::rendezvous(&job)?;
    barrier(&*joined.store, &ranks, vars.timeout)?;
    // Every rank has read the rendezvous file by now: remove it at once
    // rather than leave it for the life of the job.
    drop(joined.file);
    Ok(EnvRendezvous {
        store: joined.store,
        rank: vars.rank,
        world: vars.world,
        local_rank: vars.local_rank,
        local_world: vars.local_world,
        launcher: vars.launcher,
        server: joined.server,
        linger: vars.timeout.min(DEPART_WAIT_MAX),
        departed: AtomicBool::new(false),
    })
}

/// Rendezvous without reading the environment (for launchers and tests).
///
/// Rank 0 starts a store on `master_addr:port` (the address as resolved), then
/// every rank, rank 0 included, connects to it and waits until all `world`
/// ranks have arrived, for up to [`DEFAULT_RENDEZVOUS_TIMEOUT`].
pub fn rendezvous(
    master_addr: &str,
    port: u16,
    rank: usize,
    world: usize,
    local_rank: usize,
    token: &[u8],
) -> Result<EnvRendezvous> {
    let ranks = Ranks {
        rank,
        world,
        local_rank,
    };
    rendezvous_inner(master_addr, port, None, ranks, token, DEFAULT_RENDEZVOUS_TIMEOUT)
}

struct Ranks {
    rank: usize,
    world: usize,
    local_rank: usize,
}

fn check_ranks(ranks: &Ranks) -> Result<()> {
    if ranks.world == 0 {
        return Err(Error::invalid("WORLD_SIZE must be at least 1"));
    }
    if ranks.rank >= ranks.world {
        return Err(Error::invalid(format!(
            "RANK {} must be below WORLD_SIZE {}",
            ranks.rank, ranks.world
        )));
    }
    Ok(())
}

/// Everyone present before anyone uses the store; a rank launched with the
/// wrong WORLD_SIZE or a duplicate RANK shows up here, not later.
fn barrier(store: &dyn Store, ranks: &Ranks, timeout: Duration) -> Result<()> {
    store_barrier(store, "ferrocomm/rendezvous", ranks.rank, ranks.world, timeout)
}

fn rendezvous_inner(
    master_addr: &str,
    port: u16,
    bind: Option<IpAddr>,
    ranks: Ranks,
    token: &[u8],
    timeout: Duration,
) -> Result<EnvRendezvous> {
    check_ranks(&ranks)?;
    if port == 0 {
        return Err(Error::invalid("MASTER_PORT must be a fixed non-zero port"));
    }
    if token.is_empty() {
        return Err(missing_token());
    }
    let master = resolve(master_addr, port)?;

    let server = if ranks.rank == 0 {
        let cfg = TcpStoreConfig {
            bind_addr: bind.unwrap_or(master.ip()),
            port,
            token: token.to_vec(),
            connect_timeout: timeout,
            ..TcpStoreConfig::default()
        };
        let server = TcpStoreServer::start(cfg).map_err(|e| match e {
            Error::Io { context, source } if source.kind() == std::io::ErrorKind::AddrInUse => Error::io(
                format!(
                    "{context}: MASTER_PORT {port} is in use (rank 0 hosts the store on it); set MASTER_PORT \
                     to a free port, or launch with torchrun, whose store ferrocomm then shares"
                ),
                source,
            ),
            Error::Io { context, source } => Error::io(
                format!(
                    "{context} (rank 0 hosts the store on MASTER_ADDR; \
                     FERROCOMM_STORE_BIND=0.0.0.0 listens on every interface)"
                ),
                source,
            ),
            other => other,
        })?;
        Some(server)
    } else {
        None
    };
    let connect_to = server.as_ref().map_or(master, TcpStoreServer::connect_addr);
    let store: Arc<dyn Store> = Arc::new(TcpStore::connect(connect_to, token, timeout)?);
    barrier(&*store, &ranks, timeout)?;
    Ok(EnvRendezvous {
        store,
        rank: ranks.rank,
        world: ranks.world,
        local_rank: ranks.local_rank,
        local_world: None,
        launcher: Launcher::Plain,
        server,
        linger: timeout.min(DEPART_WAIT_MAX),
        departed: AtomicBool::new(false),
    })
}

fn resolve(master_addr: &str, port: u16) -> Result<SocketAddr> {
    (master_addr, port)
        .to_socket_addrs()
        .map_err(|e| Error::invalid(format!("MASTER_ADDR '{master_addr}' does not resolve: {e}")))?
        .next()
        .ok_or_else(|| Error::invalid(format!("MASTER_ADDR '{master_addr}' resolves to no address")))
}

fn missing_token() -> Error {
    Error::invalid(
        "no store token: set FERROCOMM_TOKEN to a per-job random secret shared by all ranks \
         (e.g. `export FERROCOMM_TOKEN=$(openssl rand -hex 32)`), or FERROCOMM_TOKEN_FILE to \
         a file holding it with mode 0600",
    )
}

/// Read a token file, refusing one that group or others can read or write.
/// Surrounding whitespace (a trailing newline) is not part of the token.
pub fn read_token_file(path: &Path) -> Result<Vec<u8>> {
    let shown = path.display();
    // Check the mode on the opened file, not the path, so the file cannot be
    // swapped between the check and the read.
    let mut file = File::open(path).map_err(|e| Error::io(format!("opening token file {shown}"), e))?;
    let meta = file
        .metadata()
        .map_err(|e| Error::io(format!("reading metadata of token file {shown}"), e))?;
    if !meta.is_file() {
        return Err(Error::invalid(format!("token file {shown} is not a regular file")));
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            return Err(Error::invalid(format!(
                "token file {shown} has mode {mode:04o}, so other users can read it; \
                 run `chmod 600 {shown}`"
            )));
        }
    }
    let mut raw = Vec::new();
    file.read_to_end(&mut raw)
        .map_err(|e| Error::io(format!("reading token file {shown}"), e))?;
    let token = raw.trim_ascii().to_vec();
    if token.is_empty() {
        return Err(Error::invalid(format!("token file {shown} is empty")));
    }
    Ok(token)
}

/// Where the token comes from, decided at parse time and read afterwards.
#[derive(Debug, PartialEq)]
enum TokenSource {
    Inline(Vec<u8>),
    File(String),
}

impl TokenSource {
    fn load(&self) -> Result<Vec<u8>> {
        match self {
            TokenSource::Inline(t) => Ok(t.clone()),
            TokenSource::File(path) => read_token_file(Path::new(path)),
        }
    }
}

/// The launcher variables, parsed and checked.
#[derive(Debug)]
struct EnvVars {
    master_addr: String,
    port: u16,
    rank: usize,
    world: usize,
    local_rank: usize,
    local_world: Option<usize>,
    bind: Option<IpAddr>,
    timeout: Duration,
    /// Required unless torchrun's agent store lets rank 0 generate one.
    token: Option<TokenSource>,
    launcher: Launcher,
    /// Set when torchrun's agent store holds `MASTER_PORT`.
    agent_store: Option<AgentStoreVars>,
}

/// The variables only the agent-store rendezvous reads.
#[derive(Debug)]
struct AgentStoreVars {
    run_id: String,
    restart_count: u64,
    xdg_runtime_dir: Option<String>,
    tmpdir: Option<String>,
}

impl EnvVars {
    /// `get` looks a variable up; it is a parameter so tests need not touch
    /// the process environment (which would race with other tests).
    fn parse(get: impl Fn(&str) -> Result<Option<String>>) -> Result<EnvVars> {
        let required = |name: &str| {
            get(name)?.ok_or_else(|| Error::invalid(format!("{name} is not set; the launcher must export it")))
        };
        let optional = |name: &str| -> Result<Option<usize>> { get(name)?.map(|v| parse_var(name, &v)).transpose() };
        let rank: usize = parse_var("RANK", &required("RANK")?)?;
        let local_rank = optional("LOCAL_RANK")?.unwrap_or(rank);
        let bind = match get("FERROCOMM_STORE_BIND")? {
            Some(v) => Some(parse_var("FERROCOMM_STORE_BIND", &v)?),
            None => None,
        };
        let timeout = match get("FERROCOMM_STORE_TIMEOUT_S")? {
            Some(v) => match parse_var::<u64>("FERROCOMM_STORE_TIMEOUT_S", &v)? {
                0 => return Err(Error::invalid("FERROCOMM_STORE_TIMEOUT_S must be at least 1 (seconds)")),
                secs => Duration::from_secs(secs),
            },
            None => DEFAULT_RENDEZVOUS_TIMEOUT,
        };
        let token = match (get("FERROCOMM_TOKEN")?, get("FERROCOMM_TOKEN_FILE")?) {
            (Some(_), Some(_)) => {
                return Err(Error::invalid(
                    "both FERROCOMM_TOKEN and FERROCOMM_TOKEN_FILE are set; set only one",
                ))
            }
            (Some(t), None) if !t.is_empty() => Some(TokenSource::Inline(t.into_bytes())),
            (None, Some(path)) if !path.is_empty() => Some(TokenSource::File(path)),
            _ => None,
        };
        let launcher = match (get("TORCHELASTIC_USE_AGENT_STORE")?, get("TORCHELASTIC_RUN_ID")?) {
            (Some(v), _) => Launcher::Torchrun {
                agent_store: parse_bool("TORCHELASTIC_USE_AGENT_STORE", &v)?,
            },
            // torchrun sets both; a run id alone still means its agent.
            (None, Some(_)) => Launcher::Torchrun { agent_store: true },
            (None, None) => Launcher::Plain,
        };
        let agent_store = match launcher {
            Launcher::Torchrun { agent_store: true } => Some(AgentStoreVars {
                run_id: run_id(get("TORCHELASTIC_RUN_ID")?)?,
                restart_count: match get("TORCHELASTIC_RESTART_COUNT")? {
                    Some(v) => parse_var("TORCHELASTIC_RESTART_COUNT", &v)?,
                    None => 0,
                },
                xdg_runtime_dir: get("XDG_RUNTIME_DIR")?,
                tmpdir: get("TMPDIR")?,
            }),
            _ => None,
        };
        if agent_store.is_none() && token.is_none() {
            return Err(missing_token());
        }
        Ok(EnvVars {
            master_addr: get("MASTER_ADDR")?.unwrap_or_else(|| "127.0.0.1".into()),
            port: parse_var("MASTER_PORT", &required("MASTER_PORT")?)?,
            rank,
            world: parse_var("WORLD_SIZE", &required("WORLD_SIZE")?)?,
            local_rank,
            local_world: optional("LOCAL_WORLD_SIZE")?,
            bind,
            timeout,
            token,
            launcher,
            agent_store,
        })
    }
}

/// torch writes Python booleans (`True`/`False`); accept the usual spellings.
fn parse_bool(name: &str, value: &str) -> Result<bool> {
    match value.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" | "" => Ok(false),
        _ => Err(Error::invalid(format!(
            "{name}='{value}' is not a boolean (True or False)"
        ))),
    }
}

/// The run id becomes part of store keys and of a line in the rendezvous
/// file, so it must be short and printable.
fn run_id(value: Option<String>) -> Result<String> {
    let id = value.unwrap_or_else(|| "none".into());
    if id.len() > MAX_RUN_ID_BYTES || id.chars().any(char::is_control) {
        return Err(Error::invalid(format!(
            "TORCHELASTIC_RUN_ID must be at most {MAX_RUN_ID_BYTES} bytes without control characters"
        )));
    }
    Ok(id)
}

fn parse_var<T: std::str::FromStr>(name: &str, value: &str) -> Result<T>
where
    T::Err: std::fmt::Display,
{
    value
        .trim()
        .parse()
        .map_err(|e| Error::invalid(format!("{name}='{value}' is not valid: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::time::Instant;

    fn parse(vars: &[(&str, &str)]) -> Result<EnvVars> {
        let map: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        EnvVars::parse(|name| Ok(map.get(name).cloned()))
    }

    const BASE: &[(&str, &str)] = &[
        ("MASTER_PORT", "29500"),
        ("RANK", "2"),
        ("WORLD_SIZE", "4"),
        ("FERROCOMM_TOKEN", "secret"),
    ];

    #[test]
    fn defaults_apply() {
        let v = parse(BASE).expect("valid variables");
        assert_eq!(v.master_addr, "127.0.0.1");
        assert_eq!((v.port, v.rank, v.world, v.local_rank), (29500, 2, 4, 2));
        assert_eq!(v.token, Some(TokenSource::Inline(b"secret".to_vec())));
        assert_eq!(v.bind, None);
        assert_eq!(v.local_world, None);
        assert_eq!(v.launcher, Launcher::Plain);
        assert!(v.agent_store.is_none());
    }

    fn with(extra: &[(&'static str, &'static str)], without: &[&str]) -> Vec<(&'static str, &'static str)> {
        let mut vars: Vec<_> = BASE.iter().filter(|(k, _)| !without.contains(k)).copied().collect();
        vars.extend_from_slice(extra);
        vars
    }

    #[test]
    fn torchrun_agent_store_is_detected_and_the_token_becomes_optional() {
        let torchrun = [
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
            ("TORCHELASTIC_RUN_ID", "job-7"),
            ("TORCHELASTIC_RESTART_COUNT", "2"),
            ("LOCAL_WORLD_SIZE", "4"),
        ];
        let v = parse(&with(&torchrun, &["FERROCOMM_TOKEN"])).expect("no token needed yet");
        assert_eq!(v.launcher, Launcher::Torchrun { agent_store: true });
        assert_eq!(v.token, None);
        assert_eq!(v.local_world, Some(4));
        let agent = v.agent_store.expect("agent store vars");
        assert_eq!((agent.run_id.as_str(), agent.restart_count), ("job-7", 2));

        // A run id alone (older torchrun) still means the agent's store.
        let v = parse(&with(&[("TORCHELASTIC_RUN_ID", "x")], &[])).expect("run id only");
        assert_eq!(v.launcher, Launcher::Torchrun { agent_store: true });

        // Without the agent store it is a plain launch: the token is required.
        let no_agent = [("TORCHELASTIC_USE_AGENT_STORE", "False"), ("TORCHELASTIC_RUN_ID", "x")];
        let v = parse(&with(&no_agent, &[])).expect("valid");
        assert_eq!(v.launcher, Launcher::Torchrun { agent_store: false });
        assert!(v.agent_store.is_none());
        let err = parse(&with(&no_agent, &["FERROCOMM_TOKEN"])).expect_err("token required");
        assert!(err.to_string().contains("FERROCOMM_TOKEN"), "{err}");
    }

    #[test]
    fn bad_torchrun_values_name_the_variable() {
        for (name, bad) in [
            ("TORCHELASTIC_USE_AGENT_STORE", "maybe"),
            ("TORCHELASTIC_RESTART_COUNT", "-1"),
            ("LOCAL_WORLD_SIZE", "four"),
            ("TORCHELASTIC_RUN_ID", "two\nlines"),
            ("FERROCOMM_STORE_TIMEOUT_S", "0"),
        ] {
            let mut vars = with(&[("TORCHELASTIC_RUN_ID", "x")], &[]);
            vars.retain(|(k, _)| *k != name);
            vars.push((name, bad));
            let err = parse(&vars).expect_err("must fail").to_string();
            assert!(err.contains(name), "{name}: {err}");
        }
    }

    #[test]
    fn a_rank_that_never_departs_is_named() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .expect("bind")
            .local_addr()
            .expect("addr")
            .port();
        let linger = Duration::from_millis(400);
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let other = std::thread::spawn(move || {
            let ranks = Ranks {
                rank: 1,
                world: 2,
                local_rank: 1,
            };
            let rdv = rendezvous_inner("127.0.0.1", port, None, ranks, b"t", Duration::from_secs(10)).expect("rank 1");
            // Never departs; keeps its connection until rank 0 is done.
            let _ = rx.recv();
            drop(rdv);
        });
        let ranks = Ranks {
            rank: 0,
            world: 2,
            local_rank: 0,
        };
        let mut rdv = rendezvous_inner("127.0.0.1", port, None, ranks, b"t", Duration::from_secs(10)).expect("rank 0");
        rdv.linger = linger;
        let start = Instant::now();
        match rdv.depart() {
            Err(Error::Timeout { missing, after, .. }) => {
                assert_eq!(missing, vec![1]);
                assert_eq!(after, linger);
            }
            other => panic!("expected a timeout naming rank 1, got {other:?}"),
        }
        assert!(
            start.elapsed() >= linger && start.elapsed() < linger * 10,
            "{:?}",
            start.elapsed()
        );
        tx.send(()).expect("rank 1 waits");
        other.join().expect("rank 1");
    }

    #[test]
    fn master_port_in_use_says_what_to_do() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = taken.local_addr().expect("addr").port();
        let err = rendezvous("127.0.0.1", port, 0, 1, 0, b"t").expect_err("port in use");
        let msg = err.to_string();
        assert!(
            msg.contains("MASTER_PORT") && msg.contains("in use") && msg.contains("torchrun"),
            "{msg}"
        );
    }

    #[test]
    fn bad_values_name_the_variable() {
        for (name, bad) in [
            ("RANK", "x"),
            ("WORLD_SIZE", "-1"),
            ("MASTER_PORT", "70000"),
            ("LOCAL_RANK", "a"),
        ] {
            let mut vars: Vec<_> = BASE.iter().filter(|(k, _)| *k != name).copied().collect();
            vars.push((name, bad));
            let err = parse(&vars).expect_err("must fail").to_string();
            assert!(err.contains(name), "{err}");
        }
    }

    #[test]
    fn missing_port_and_token_are_explained() {
        let no_port: Vec<_> = BASE.iter().filter(|(k, _)| *k != "MASTER_PORT").copied().collect();
        assert!(parse(&no_port)
            .expect_err("must fail")
            .to_string()
            .contains("MASTER_PORT"));
        let no_token: Vec<_> = BASE.iter().filter(|(k, _)| *k != "FERROCOMM_TOKEN").copied().collect();
        assert!(parse(&no_token)
            .expect_err("must fail")
            .to_string()
            .contains("FERROCOMM_TOKEN"));
        let mut both = BASE.to_vec();
        both.push(("FERROCOMM_TOKEN_FILE", "/tmp/t"));
        assert!(parse(&both).is_err());
    }

    #[test]
    fn rank_must_be_below_world() {
        let err = rendezvous("127.0.0.1", 1, 3, 3, 0, b"t").expect_err("must fail");
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
        let err = rendezvous("127.0.0.1", 1, 0, 0, 0, b"t").expect_err("must fail");
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    }
}
