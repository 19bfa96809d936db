//! Rendezvous from the usual launcher variables (torchrun, mpirun wrappers,
//! Slurm scripts): rank 0 runs the TCP store, every rank connects to it.
//!
//! Variables: `MASTER_ADDR` (default 127.0.0.1), `MASTER_PORT` (required),
//! `RANK`, `WORLD_SIZE`, `LOCAL_RANK` (default `RANK`), and the job token in
//! `FERROCOMM_TOKEN` or in a mode-0600 file named by `FERROCOMM_TOKEN_FILE`.
//! `FERROCOMM_STORE_BIND` overrides the address rank 0 listens on (e.g.
//! `0.0.0.0`); `FERROCOMM_STORE_TIMEOUT_S` the connect/arrival timeout.

use std::fs::File;
use std::io::Read;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use super::collect::store_barrier;
use super::tcp::{TcpStore, TcpStoreConfig, TcpStoreServer};
use super::Store;
use crate::error::{Error, Result};

/// How long ranks wait for the server and for each other by default. Generous
/// because launchers start ranks on different hosts at different times.
pub const DEFAULT_RENDEZVOUS_TIMEOUT: Duration = Duration::from_secs(300);

/// The result of a rendezvous: a connected store and this rank's place.
pub struct EnvRendezvous {
    pub store: Arc<dyn Store>,
    pub rank: usize,
    pub world: usize,
    pub local_rank: usize,
    /// Rank 0 owns the server; it lives as long as this value.
    server: Option<TcpStoreServer>,
}

impl EnvRendezvous {
    /// Whether this rank hosts the store server (and must outlive the others' use of it).
    pub fn hosts_server(&self) -> bool {
        self.server.is_some()
    }
}

impl std::fmt::Debug for EnvRendezvous {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EnvRendezvous")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("local_rank", &self.local_rank)
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
    let token = vars.token.load()?;
    rendezvous_inner(
        &vars.master_addr,
        vars.port,
        vars.bind,
        Ranks {
            rank: vars.rank,
            world: vars.world,
            local_rank: vars.local_rank,
        },
        &token,
        vars.timeout,
    )
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

fn rendezvous_inner(
    master_addr: &str,
    port: u16,
    bind: Option<IpAddr>,
    ranks: Ranks,
    token: &[u8],
    timeout: Duration,
) -> Result<EnvRendezvous> {
    let Ranks {
        rank,
        world,
        local_rank,
    } = ranks;
    if world == 0 {
        return Err(Error::invalid("WORLD_SIZE must be at least 1"));
    }
    if rank >= world {
        return Err(Error::invalid(format!("RANK {rank} must be below WORLD_SIZE {world}")));
    }
    if port == 0 {
        return Err(Error::invalid("MASTER_PORT must be a fixed non-zero port"));
    }
    if token.is_empty() {
        return Err(missing_token());
    }
    let master = resolve(master_addr, port)?;

    let server = if rank == 0 {
        let cfg = TcpStoreConfig {
            bind_addr: bind.unwrap_or(master.ip()),
            port,
            token: token.to_vec(),
            connect_timeout: timeout,
            ..TcpStoreConfig::default()
        };
        let server = TcpStoreServer::start(cfg).map_err(|e| match e {
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
    // Everyone present before anyone uses the store; a rank launched with the
    // wrong WORLD_SIZE or a duplicate RANK shows up here, not later.
    store_barrier(&*store, "ferrocomm/rendezvous", rank, world, timeout)?;
    Ok(EnvRendezvous {
        store,
        rank,
        world,
        local_rank,
        server,
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
    bind: Option<IpAddr>,
    timeout: Duration,
    token: TokenSource,
}

impl EnvVars {
    /// `get` looks a variable up; it is a parameter so tests need not touch
    /// the process environment (which would race with other tests).
    fn parse(get: impl Fn(&str) -> Result<Option<String>>) -> Result<EnvVars> {
        let required = |name: &str| {
            get(name)?.ok_or_else(|| Error::invalid(format!("{name} is not set; the launcher must export it")))
        };
        let rank: usize = parse_var("RANK", &required("RANK")?)?;
        let local_rank = match get("LOCAL_RANK")? {
            Some(v) => parse_var("LOCAL_RANK", &v)?,
            None => rank,
        };
        let bind = match get("FERROCOMM_STORE_BIND")? {
            Some(v) => Some(parse_var("FERROCOMM_STORE_BIND", &v)?),
            None => None,
        };
        let timeout = match get("FERROCOMM_STORE_TIMEOUT_S")? {
            Some(v) => Duration::from_secs(parse_var("FERROCOMM_STORE_TIMEOUT_S", &v)?),
            None => DEFAULT_RENDEZVOUS_TIMEOUT,
        };
        let token = match (get("FERROCOMM_TOKEN")?, get("FERROCOMM_TOKEN_FILE")?) {
            (Some(_), Some(_)) => {
                return Err(Error::invalid(
                    "both FERROCOMM_TOKEN and FERROCOMM_TOKEN_FILE are set; set only one",
                ))
            }
            (Some(t), None) if !t.is_empty() => TokenSource::Inline(t.into_bytes()),
            (None, Some(path)) if !path.is_empty() => TokenSource::File(path),
            _ => return Err(missing_token()),
        };
        Ok(EnvVars {
            master_addr: get("MASTER_ADDR")?.unwrap_or_else(|| "127.0.0.1".into()),
            port: parse_var("MASTER_PORT", &required("MASTER_PORT")?)?,
            rank,
            world: parse_var("WORLD_SIZE", &required("WORLD_SIZE")?)?,
            local_rank,
            bind,
            timeout,
            token,
        })
    }
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
        assert_eq!(v.token, TokenSource::Inline(b"secret".to_vec()));
        assert_eq!(v.bind, None);
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
