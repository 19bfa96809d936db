//! Communicator options, with environment overrides.

use std::time::Duration;

use crate::codec::Quantization;
use crate::error::{Error, Result};
use crate::plan::{parse_choice, Algorithm};

/// How a communicator behaves. `Default` is the documented default; `from_env`
/// applies `FERROCOMM_*` variables on top.
#[derive(Debug, Clone)]
pub struct CommOptions {
    /// Bound on every wait, on the host and in kernels (`FERROCOMM_TIMEOUT_SECONDS`, default 600 s).
    pub timeout: Duration,
    /// Only paths that give bitwise-identical results across ranks, runs and
    /// algorithms (`FERROCOMM_DETERMINISTIC`, default on).
    pub deterministic: bool,
    /// The all-reduce's algorithm for every call that does not name one
    /// (`FERROCOMM_ALGO`: `auto`, or an all-reduce [`Algorithm`]'s name,
    /// `nccl` among its aliases). `None`: the planner's choice.
    pub algo: Option<Algorithm>,
    /// Where all-gather, gather, scatter, all-to-all(-v), reduce-scatter and
    /// reduce run on GPUs: [`Algorithm::Kernels`] or [`Algorithm::Vendor`]
    /// (`FERROCOMM_COLL_ROUTE=auto|custom|vendor`, default auto; every rank
    /// must ask for the same). Without the library the kernels run whatever
    /// is asked. `None` lets the planner choose (the tuned table for
    /// all-gather, reduce-scatter and all-to-all without splits); a set
    /// route wins over the table, a call's `coll_algo` over the route.
    pub coll_route: Option<Algorithm>,
    /// Bytes per workspace data slot; payloads above it are chunked
    /// (`FERROCOMM_SLOT_BYTES`). `None` takes the backend's default: 32 MiB on
    /// GPUs (measured on H200: large two-shot pushes reach NCCL's bandwidth only
    /// with slots this big; the workspace is then 160 MiB per rank), 8 MiB on the host.
    pub slot_bytes: Option<usize>,
    /// Opt-in quantized all-reduce for large f16/bf16 sums
    /// (`FERROCOMM_QUICK_REDUCE=fp8|int8|int6|int4|fp4|none`, default none).
    pub quantization: Quantization,
    /// The communicator's name (logs, errors); derived from its creation
    /// order when unset.
    pub name: Option<String>,
    /// Split one host into pseudo-nodes of this many consecutive ranks, to
    /// run multi-node paths on one machine (`FERROCOMM_LOCAL_SIZE`; every
    /// rank must set the same value). `None`: nodes are real hosts.
    pub local_size: Option<usize>,
    /// Time the algorithms of all-reduce, all-gather, reduce-scatter and
    /// all-to-all at init and dispatch by the result, cached on disk
    /// (`FERROCOMM_AUTOTUNE=0|1`; `comm/autotune.rs`). `None`: on for GPUs,
    /// off on the host backend. Explicit choices (`algo`, `coll_route`,
    /// `coll_ll_bytes`, a call's `algo` or `coll_algo`) win over its table.
    pub autotune: Option<bool>,
    /// Load every kernel when the communicator is created
    /// (`FERROCOMM_PRELOAD_KERNELS=0|1`). `None`: only where a peer rank is
    /// a thread of this process on a GPU (`Communicator::new` says why);
    /// elsewhere kernels load when first launched.
    pub preload_kernels: Option<bool>,
    /// Bytes of each rank's symmetric heap (`FERROCOMM_HEAP_BYTES`; every
    /// rank must set the same). `None` takes the backend's default: 1 GiB on
    /// GPUs (NVSHMEM's default; EP dispatch/combine at hidden 7168 and 4096
    /// tokens per rank needs about 240 MiB per peer), 64 MiB on the host. The
    /// heap is reserved on its first use, not at creation.
    pub heap_bytes: Option<usize>,
    /// Largest agreed per-peer block (bytes) the exchange and reduce-to
    /// kernels carry on LL lines, the small-message kinds
    /// (`FERROCOMM_COLL_LL_BYTES`; 0 turns them off; every rank must set
    /// the same). `None`: 256 KiB to world 4 (measured on 2x H200 and 4x
    /// H100), 32 KiB above (`algo::dispatch::ll_max_block_bytes`),
    /// or for all-gather, reduce-scatter and all-to-all without splits what
    /// autotune measured. A block also has to fit one source's LL lines (a
    /// quarter of a slot over the world). `auto` routes such blocks to the
    /// kernels, not NCCL. Set, it wins over the tuned table (which then
    /// never picks LL); a call's `coll_algo` wins over it.
    pub coll_ll_bytes: Option<usize>,
    /// Smallest agreed per-peer block (bytes) from which all-gather, gather,
    /// scatter (outputs in the heap), reduce-scatter and reduce (inputs in
    /// the heap) take the direct kinds (`fc_exchange_direct`,
    /// `fc_reduce_to_direct_*`; docs/protocol.md "Direct exchange") when the
    /// communicator has a symmetric heap (`FERROCOMM_DIRECT_MIN_BYTES`, a
    /// byte count; every rank must set the same, as the choice must come
    /// out alike on every rank). `Some(n)`: direct from `n` bytes a peer, on
    /// GPUs and on the host; calls without an agreed block (all-to-alls)
    /// count as 0 bytes, so only `Some(0)` sends them direct. `None`: the
    /// defaults measured on 2x H200, 1 MiB a peer for the exchange and 8 MiB
    /// for the reduce-to on GPUs (`comm::collectives::DIRECT_MIN_BLOCK_BYTES`,
    /// `DIRECT_MIN_REDUCE_TO_BYTES`), always on the host.
    pub direct_min_bytes: Option<usize>,
    /// Blocks of the EP dispatch and combine kernels on GPUs
    /// (`FERROCOMM_EP_BLOCKS`, 1 to 128, at most the GPU's
    /// multiprocessors). `None`: 128 (`ep::EP_GPU_BLOCKS`).
    pub ep_blocks: Option<u32>,
    /// The EP combine as two kernels with a flag wait between them even
    /// where rows allow the one-kernel Lamport combine
    /// (`FERROCOMM_EP_PLAIN_COMBINE=1`; every rank alike). For comparison;
    /// off by default.
    pub ep_plain_combine: bool,
    /// Launch the EP kernels as programmatic dependents of the stream's
    /// previous kernel, so that their blocks start while it ends (CUDA,
    /// compute capability 9.0 and up; `FERROCOMM_EP_DEPENDENT_LAUNCH=0`
    /// turns it off, for comparison). On by default.
    pub ep_dependent_launch: bool,
}

impl Default for CommOptions {
    fn default() -> Self {
        CommOptions {
            timeout: Duration::from_secs(600),
            deterministic: true,
            algo: None,
            coll_route: None,
            slot_bytes: None,
            quantization: Quantization::None,
            name: None,
            local_size: None,
            autotune: None,
            preload_kernels: None,
            heap_bytes: None,
            coll_ll_bytes: None,
            direct_min_bytes: None,
            ep_blocks: None,
            ep_plain_combine: false,
            ep_dependent_launch: true,
        }
    }
}

/// `FERROCOMM_ALGO`: `auto` or an all-reduce algorithm.
fn all_reduce_choice(v: &str) -> Result<Option<Algorithm>> {
    match parse_choice(v)? {
        Some(a) if !a.is_all_reduce() => Err(Error::invalid(format!(
            "FERROCOMM_ALGO={v:?} is not an all-reduce algorithm (`coll_algo` hints name the others' kinds)"
        ))),
        a => Ok(a),
    }
}

/// `FERROCOMM_COLL_ROUTE`: `auto`, the kernels (`custom`) or the library
/// (`vendor`).
fn route_choice(v: &str) -> Result<Option<Algorithm>> {
    let bad = || Error::invalid(format!("FERROCOMM_COLL_ROUTE={v:?} is not one of auto, custom, vendor"));
    match parse_choice(v).map_err(|_| bad())? {
        a @ (None | Some(Algorithm::Kernels | Algorithm::Vendor)) => Ok(a),
        Some(_) => Err(bad()),
    }
}

fn env_var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

/// A byte count from the environment (a plain integer, no suffix).
fn byte_count(name: &str, v: &str) -> Result<usize> {
    v.trim()
        .parse()
        .map_err(|_| Error::invalid(format!("{name}={v:?} is not a byte count")))
}

/// An on/off environment value.
fn switch(name: &str, v: &str) -> Result<bool> {
    match v.trim() {
        "1" | "true" | "on" | "yes" => Ok(true),
        "0" | "false" | "off" | "no" => Ok(false),
        _ => Err(Error::invalid(format!("{name}={v:?} is not 0 or 1"))),
    }
}

impl CommOptions {
    /// The slot size in force on a backend.
    pub fn slot_bytes_for(&self, backend: crate::device::BackendKind) -> usize {
        self.slot_bytes.unwrap_or(match backend {
            crate::device::BackendKind::Host => 8 << 20,
            _ => 32 << 20,
        })
    }

    /// The symmetric heap's size in force on a backend.
    pub fn heap_bytes_for(&self, backend: crate::device::BackendKind) -> usize {
        self.heap_bytes.unwrap_or(match backend {
            crate::device::BackendKind::Host => 64 << 20,
            _ => 1 << 30,
        })
    }

    /// Defaults, overridden by the environment.
    pub fn from_env() -> Result<Self> {
        let mut o = CommOptions::default();
        if let Some(v) = env_var("FERROCOMM_TIMEOUT_SECONDS") {
            let secs: f64 = v
                .trim()
                .parse()
                .ok()
                .filter(|s: &f64| s.is_finite() && *s > 0.0)
                .ok_or_else(|| Error::invalid(format!("FERROCOMM_TIMEOUT_SECONDS={v:?} is not a positive number")))?;
            o.timeout = Duration::from_secs_f64(secs);
        }
        if let Some(v) = env_var("FERROCOMM_DETERMINISTIC") {
            o.deterministic = switch("FERROCOMM_DETERMINISTIC", &v)?;
        }
        if let Some(v) = env_var("FERROCOMM_AUTOTUNE") {
            o.autotune = Some(switch("FERROCOMM_AUTOTUNE", &v)?);
        }
        if let Some(v) = env_var("FERROCOMM_PRELOAD_KERNELS") {
            o.preload_kernels = Some(switch("FERROCOMM_PRELOAD_KERNELS", &v)?);
        }
        if let Some(v) = env_var("FERROCOMM_ALGO") {
            o.algo = all_reduce_choice(&v)?;
        }
        if let Some(v) = env_var("FERROCOMM_COLL_ROUTE") {
            o.coll_route = route_choice(&v)?;
        }
        if let Some(v) = env_var("FERROCOMM_SLOT_BYTES") {
            o.slot_bytes = Some(byte_count("FERROCOMM_SLOT_BYTES", &v)?);
        }
        if let Some(v) = env_var("FERROCOMM_HEAP_BYTES") {
            o.heap_bytes = Some(byte_count("FERROCOMM_HEAP_BYTES", &v)?);
        }
        if let Some(v) = env_var("FERROCOMM_DIRECT_MIN_BYTES") {
            o.direct_min_bytes = Some(byte_count("FERROCOMM_DIRECT_MIN_BYTES", &v)?);
        }
        if let Some(v) = env_var("FERROCOMM_COLL_LL_BYTES") {
            o.coll_ll_bytes = Some(byte_count("FERROCOMM_COLL_LL_BYTES", &v)?);
        }
        if let Some(v) = env_var("FERROCOMM_EP_BLOCKS") {
            let max = crate::algo::layout::MAX_BLOCKS as u32;
            let b = v.trim().parse::<u32>().ok().filter(|b| (1..=max).contains(b));
            o.ep_blocks = Some(b.ok_or_else(|| {
                Error::invalid(format!(
                    "FERROCOMM_EP_BLOCKS={v:?} is not a block count from 1 to {max}"
                ))
            })?);
        }
        if let Some(v) = env_var("FERROCOMM_EP_PLAIN_COMBINE") {
            o.ep_plain_combine = switch("FERROCOMM_EP_PLAIN_COMBINE", &v)?;
        }
        if let Some(v) = env_var("FERROCOMM_EP_DEPENDENT_LAUNCH") {
            o.ep_dependent_launch = switch("FERROCOMM_EP_DEPENDENT_LAUNCH", &v)?;
        }
        if let Some(v) = env_var("FERROCOMM_QUICK_REDUCE") {
            o.quantization = v.parse()?;
        }
        if let Some(v) = env_var("FERROCOMM_LOCAL_SIZE") {
            let k = v.trim().parse::<usize>().ok().filter(|&k| k > 0);
            o.local_size =
                Some(k.ok_or_else(|| {
                    Error::invalid(format!("FERROCOMM_LOCAL_SIZE={v:?} is not a positive rank count"))
                })?);
        }
        Ok(o)
    }

    /// See [`CommOptions::timeout`].
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// See [`CommOptions::algo`].
    pub fn with_algo(mut self, algo: Algorithm) -> Self {
        self.algo = Some(algo);
        self
    }

    /// See [`CommOptions::coll_route`]: [`Algorithm::Kernels`] or
    /// [`Algorithm::Vendor`].
    pub fn with_coll_route(mut self, route: Algorithm) -> Self {
        self.coll_route = Some(route);
        self
    }

    /// See [`CommOptions::coll_ll_bytes`] (0: never the LL kinds).
    pub fn with_coll_ll_bytes(mut self, bytes: usize) -> Self {
        self.coll_ll_bytes = Some(bytes);
        self
    }

    /// See [`CommOptions::quantization`].
    pub fn with_quantization(mut self, q: Quantization) -> Self {
        self.quantization = q;
        self
    }

    /// See [`CommOptions::name`].
    pub fn with_name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// See [`CommOptions::slot_bytes`].
    pub fn with_slot_bytes(mut self, bytes: usize) -> Self {
        self.slot_bytes = Some(bytes);
        self
    }

    /// Autotune at init on or off (see [`CommOptions::autotune`]).
    pub fn with_autotune(mut self, on: bool) -> Self {
        self.autotune = Some(on);
        self
    }

    /// Whether autotune runs on `backend`.
    pub fn autotune_for(&self, backend: crate::device::BackendKind) -> bool {
        self.autotune.unwrap_or(backend != crate::device::BackendKind::Host)
    }

    /// Preload every kernel at creation on or off (see
    /// [`CommOptions::preload_kernels`]).
    pub fn with_preload_kernels(mut self, on: bool) -> Self {
        self.preload_kernels = Some(on);
        self
    }

    /// A symmetric heap of `bytes` per rank (see [`CommOptions::heap_bytes`]).
    pub fn with_heap_bytes(mut self, bytes: usize) -> Self {
        self.heap_bytes = Some(bytes);
        self
    }

    /// The direct kinds from `bytes` a peer (see [`CommOptions::direct_min_bytes`]).
    pub fn with_direct_min_bytes(mut self, bytes: usize) -> Self {
        self.direct_min_bytes = Some(bytes);
        self
    }

    /// Pseudo-nodes of `ranks` consecutive ranks (see [`CommOptions::local_size`]).
    pub fn with_local_size(mut self, ranks: usize) -> Self {
        self.local_size = Some(ranks);
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_documented_environment_values_still_parse() {
        assert_eq!(route_choice("auto").unwrap(), None);
        assert_eq!(route_choice(" Custom ").unwrap(), Some(Algorithm::Kernels));
        assert_eq!(route_choice("vendor").unwrap(), Some(Algorithm::Vendor));
        assert_eq!(route_choice("nccl").unwrap(), Some(Algorithm::Vendor));
        let m = route_choice("fast").unwrap_err().to_string();
        assert!(m.contains("FERROCOMM_COLL_ROUTE") && m.contains("\"fast\""), "{m}");
        assert!(route_choice("ll").is_err());
        assert_eq!(all_reduce_choice("auto").unwrap(), None);
        assert_eq!(all_reduce_choice("nccl").unwrap(), Some(Algorithm::Vendor));
        assert_eq!(all_reduce_choice("oneshot_push").unwrap(), Some(Algorithm::OneShotPush));
        assert!(all_reduce_choice("inbox").is_err());
        assert!(all_reduce_choice("threeshot").is_err());
    }

    #[test]
    fn byte_counts_parse_and_name_the_variable_on_errors() {
        assert_eq!(byte_count("FERROCOMM_DIRECT_MIN_BYTES", "0").unwrap(), 0);
        assert_eq!(byte_count("FERROCOMM_DIRECT_MIN_BYTES", " 4194304 ").unwrap(), 4 << 20);
        for bad in ["4M", "-1", "1.5", "lots"] {
            let e = byte_count("FERROCOMM_DIRECT_MIN_BYTES", bad).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)), "{bad}: {e:?}");
            let m = e.to_string();
            assert!(
                m.contains("FERROCOMM_DIRECT_MIN_BYTES") && m.contains(&format!("{bad:?}")),
                "{m}"
            );
        }
        assert_eq!(CommOptions::default().direct_min_bytes, None);
        assert_eq!(
            CommOptions::default().with_direct_min_bytes(0).direct_min_bytes,
            Some(0)
        );
    }
}
