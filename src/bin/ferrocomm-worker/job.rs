//! This rank's place in the job: the store, its rank and the world, from a
//! launcher-hosted store or the torchrun variables; and the GPU it opens.

use std::sync::Arc;
use std::time::Duration;

use ferrocomm::bootstrap::{rendezvous_from_env, EnvRendezvous, Store, TcpStore};
use ferrocomm::{Error, Result};

pub struct Job {
    pub store: Arc<dyn Store>,
    pub rank: usize,
    pub world: usize,
    pub local_rank: usize,
    /// Keeps the store server alive when this rank hosts it (see `run`).
    pub rdv: Option<EnvRendezvous>,
}

fn env_usize(name: &str) -> Result<usize> {
    let v = std::env::var(name).map_err(|_| Error::invalid(format!("{name} is not set")))?;
    v.parse()
        .map_err(|_| Error::invalid(format!("{name}={v:?} is not a number")))
}

/// Join the job through a launcher-hosted store, or through torchrun variables.
pub fn connect() -> Result<Job> {
    if let Ok(addr) = std::env::var("FERROCOMM_STORE_ADDR") {
        let addr = addr
            .parse()
            .map_err(|_| Error::invalid(format!("FERROCOMM_STORE_ADDR={addr:?}")))?;
        let token = std::env::var("FERROCOMM_TOKEN").map_err(|_| Error::invalid("FERROCOMM_TOKEN is not set"))?;
        let store: Arc<dyn Store> = Arc::new(TcpStore::connect(addr, token.as_bytes(), Duration::from_secs(30))?);
        let rank = env_usize("RANK")?;
        return Ok(Job {
            store,
            rank,
            world: env_usize("WORLD_SIZE")?,
            local_rank: env_usize("LOCAL_RANK").unwrap_or(rank),
            rdv: None,
        });
    }
    let rdv = rendezvous_from_env()?;
    Ok(Job {
        store: rdv.store.clone(),
        rank: rdv.rank,
        world: rdv.world,
        local_rank: rdv.local_rank,
        rdv: Some(rdv),
    })
}
