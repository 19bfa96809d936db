//! The bench's flags ([`USAGE`]): [`Args`], parsed from the command line,
//! checked, and completed (`--algo all`, `--fused-moe` alone).

use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use ferrocomm::algo::kernels::QR_DTYPES;
use ferrocomm::codec::Quantization;
use ferrocomm::device::BackendKind;
use ferrocomm::{DType, Error, FusionPattern, ReduceOp, Result, SfLayout, SpOutput};

use crate::colls::Coll;

pub const USAGE: &str =
    "usage: ferrocomm-bench [--backend host|cuda|hip] [--world N] [--coll all_reduce|all_gather|reduce_scatter|all_to_all|broadcast|reduce|sendrecv|all]
                       [--dtype f32|f16|bf16|i32] [--op sum|prod|min|max|avg]
                       [--min-bytes B] [--max-bytes B] [--iters N] [--warmup N] [--algo auto|oneshot|twoshot|oneshot-push|twoshot-push|oneshot-ll|ll|inbox|copy|nccl|all]
                       [--graph] [--graph-only] [--eager-only] [--json FILE] [--plot FILE.svg] [--timeout-secs S]
                       [--operands plain|heap|both]  (--coll rows' buffers: comm.alloc, the symmetric heap, or both
                        side by side; heap operands take the direct kinds from FERROCOMM_DIRECT_MIN_BYTES a peer)
                       [--quantization int4,int6,int8,fp8,fp4]
                       [--fused res,rms,rms_fp8,rms_fp8tok,rms_i8tok,rms_nvfp4|all [--tokens 1,32,128,2048] [--hidden 4096]
                        [--fused-moe TOPK,..] [--fused-sp gathered,shard|all] [--sf-layout swizzled|linear]]
                       [--heap]  (device put vs copy engine, user all-gather vs all_gather)
                       [--broadcaster]  (the metadata broadcaster: msgs/s and latency at 64 B, 4 KiB, 1 MiB)
                       [--ep [--tokens 1,8,32,128,512,1024,4096] [--hidden 7168] [--experts 256] [--topk 8] [--eager-only]]
sizes take K, M, G suffixes (powers of 1024); --iters and --warmup default to 20 and 5 on GPUs, 5 and 1 on the host";

/// What `--algo all` stands for, in the order the rows are timed.
const ALL_ALGOS: [&str; 7] = [
    "auto",
    "oneshot-ll",
    "oneshot-push",
    "twoshot-push",
    "oneshot",
    "twoshot",
    "nccl",
];

/// Where a `--coll` row's buffers live (`operands.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operands {
    Plain,
    Heap,
}

impl Operands {
    pub fn name(self) -> &'static str {
        match self {
            Operands::Plain => "plain",
            Operands::Heap => "heap",
        }
    }
}

#[derive(Clone, Debug)]
pub struct Args {
    pub backend: String,
    pub world: usize,
    pub colls: Vec<Coll>,
    pub dtypes: Vec<DType>,
    pub op: ReduceOp,
    pub min_bytes: usize,
    pub max_bytes: usize,
    /// `None`: the backend's default (see [`Args::iters_for`]).
    pub iters: Option<usize>,
    pub warmup: Option<usize>,
    pub algos: Vec<String>,
    pub graph: bool,
    pub eager: bool,
    pub json: Option<PathBuf>,
    pub plot: Option<PathBuf>,
    pub timeout: Duration,
    /// Quick-reduce codecs to add rows for (Gaussian data, relative error).
    pub quantization: Vec<Quantization>,
    /// `--fused`: time the fused all-reduce epilogues of these patterns
    /// (rows of `hidden`, `tokens` each) instead of the collectives.
    pub fused: Option<Vec<FusionPattern>>,
    /// `--fused-moe`: top-k values of MoE-finalize rows (fused, and the
    /// unfused pipeline beside them) added to the fused table.
    pub fused_moe: Vec<usize>,
    /// `--fused-sp`: the sequence-parallel forms (`reduce_scatter_fused`)
    /// whose rows are added to the fused table, per pattern and size.
    pub fused_sp: Vec<SpOutput>,
    /// `--sf-layout`: where NVFP4 rows write their scale factors
    /// (FlashInfer's swizzled 128x4 tiles by default, or row-major).
    pub sf_layout: SfLayout,
    pub tokens: Vec<usize>,
    pub hidden: usize,
    /// `--heap`: the symmetric heap's rows (`heap.rs`) instead of the collectives.
    pub heap: bool,
    /// `--broadcaster`: the metadata broadcaster's rows (`broadcaster.rs`).
    pub broadcaster: bool,
    /// `--operands`: where the `--coll` rows' buffers live (plain first).
    pub operands: Vec<Operands>,
    /// `--ep`: time EP dispatch + combine against an all-to-all-v pipeline.
    pub ep: bool,
    /// Whether `--tokens` / `--hidden` were given (`--ep` has its own defaults).
    pub tokens_given: bool,
    pub hidden_given: bool,
    pub experts: Option<usize>,
    pub topk: Option<usize>,
    /// `--eager-only` was given (`--ep` replays graphs otherwise).
    pub eager_only: bool,
}

impl Default for Args {
    fn default() -> Self {
        Args {
            backend: "host".into(),
            world: 2,
            colls: vec![Coll::AllReduce],
            dtypes: vec![DType::BF16],
            op: ReduceOp::Sum,
            min_bytes: 1 << 10,
            max_bytes: 64 << 20,
            iters: None,
            warmup: None,
            algos: vec!["auto".into()],
            graph: false,
            eager: true,
            json: None,
            plot: None,
            timeout: Duration::from_secs(60),
            quantization: Vec::new(),
            fused: None,
            heap: false,
            broadcaster: false,
            operands: vec![Operands::Plain],
            fused_moe: Vec::new(),
            fused_sp: Vec::new(),
            sf_layout: SfLayout::Swizzled128x4,
            tokens: vec![1, 32, 128, 2048],
            hidden: 4096,
            ep: false,
            tokens_given: false,
            hidden_given: false,
            experts: None,
            topk: None,
            eager_only: false,
        }
    }
}

impl Args {
    /// Timed samples per row: fewer on the host, where a sample of a large
    /// size takes tens of milliseconds, so the default sweep stays short.
    pub fn iters_for(&self, backend: BackendKind) -> usize {
        self.iters.unwrap_or(if backend == BackendKind::Host { 5 } else { 20 })
    }

    pub fn warmup_for(&self, backend: BackendKind) -> usize {
        self.warmup.unwrap_or(if backend == BackendKind::Host { 1 } else { 5 })
    }

    /// The modes the `--coll`, `--fused` and `--heap` rows are timed in.
    pub fn modes(&self) -> &'static [&'static str] {
        match (self.eager, self.graph) {
            (true, true) => &["eager", "graph"],
            (false, true) => &["graph"],
            _ => &["eager"],
        }
    }

    /// The `--coll` rows' sizes for `dtype`: powers of two from `--min-bytes`
    /// (at least one element a rank) to `--max-bytes`.
    pub fn sizes(&self, dtype: DType, world: usize) -> impl Iterator<Item = usize> {
        let first = self.min_bytes.max(dtype.size() * world);
        let max = self.max_bytes;
        std::iter::successors(Some(first), |b| b.checked_mul(2)).take_while(move |&b| b <= max)
    }

    /// One flag, and its value from `rest` where it takes one.
    fn take(&mut self, flag: &str, rest: &mut impl Iterator<Item = String>) -> Result<()> {
        let mut value = || {
            rest.next()
                .ok_or_else(|| Error::invalid(format!("{flag} needs a value\n{USAGE}")))
        };
        match flag {
            "--backend" => self.backend = value()?,
            "--world" => self.world = number(flag, &value()?)?,
            "--coll" => self.colls = parse_colls(&value()?)?,
            "--dtype" => self.dtypes = value()?.split(',').map(str::parse).collect::<Result<_>>()?,
            "--op" => self.op = value()?.parse()?,
            "--min-bytes" => self.min_bytes = parse_size(&value()?)?,
            "--max-bytes" => self.max_bytes = parse_size(&value()?)?,
            "--iters" => self.iters = Some(number(flag, &value()?)?),
            "--warmup" => self.warmup = Some(number(flag, &value()?)?),
            "--algo" => self.algos = value()?.split(',').map(String::from).collect(),
            "--graph" => self.graph = true,
            "--eager-only" => (self.graph, self.eager_only) = (false, true),
            "--graph-only" => (self.graph, self.eager) = (true, false),
            "--quantization" => self.quantization = parse_quantization(&value()?)?,
            "--fused" => self.fused = Some(parse_patterns(&value()?)?),
            "--heap" => self.heap = true,
            "--broadcaster" => self.broadcaster = true,
            "--operands" => self.operands = parse_operands(&value()?)?,
            "--fused-moe" => self.fused_moe = parse_topks(&value()?)?,
            "--fused-sp" => self.fused_sp = parse_sp(&value()?)?,
            "--sf-layout" => self.sf_layout = parse_sf_layout(&value()?)?,
            "--ep" => self.ep = true,
            "--experts" => self.experts = Some(number(flag, &value()?)?),
            "--topk" => self.topk = Some(number(flag, &value()?)?),
            "--tokens" => (self.tokens, self.tokens_given) = (parse_tokens(&value()?)?, true),
            "--hidden" => (self.hidden, self.hidden_given) = (number(flag, &value()?)?, true),
            "--json" => self.json = Some(PathBuf::from(value()?)),
            "--plot" => self.plot = Some(PathBuf::from(value()?)),
            "--timeout-secs" => self.timeout = Duration::from_secs(number(flag, &value()?)?),
            "-h" | "--help" => return Err(Error::invalid(USAGE)),
            _ => return Err(Error::invalid(format!("unknown flag {flag}\n{USAGE}"))),
        }
        Ok(())
    }

    /// Flags that do not go together.
    fn check(&self) -> Result<()> {
        if self.iters == Some(0) || self.world == 0 || self.min_bytes > self.max_bytes {
            return Err(Error::invalid(format!(
                "need --iters > 0, --world > 0 and --min-bytes <= --max-bytes\n{USAGE}"
            )));
        }
        if !self.quantization.is_empty()
            && (self.op != ReduceOp::Sum || self.dtypes.iter().any(|d| !QR_DTYPES.contains(d)))
        {
            return Err(Error::invalid("--quantization runs f16/bf16 sums only"));
        }
        let other_rows = self.fused.is_some()
            || !self.fused_moe.is_empty()
            || !self.fused_sp.is_empty()
            || self.heap
            || self.broadcaster
            || self.ep;
        if self.operands != [Operands::Plain] && other_rows {
            return Err(Error::invalid(
                "--operands heap|both applies to the --coll rows, not to --fused, --fused-moe, --heap or --ep",
            ));
        }
        Ok(())
    }

    /// What a flag implies: MoE rows alone take the pattern of a MoE
    /// layer's end; `--algo all` is every algorithm.
    fn complete(mut self) -> Self {
        if (!self.fused_moe.is_empty() || !self.fused_sp.is_empty()) && self.fused.is_none() {
            self.fused = Some(vec![FusionPattern::ResidualRmsNorm]);
        }
        if self.algos.iter().any(|x| x == "all") {
            self.algos = ALL_ALGOS.map(String::from).to_vec();
        }
        self
    }
}

/// The command line's flags.
pub fn parse_args() -> Result<Args> {
    let mut a = Args::default();
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        a.take(&flag, &mut it)?;
    }
    a.check()?;
    Ok(a.complete())
}

/// A count: `4096`, `64K`, `16M`, `1G` (powers of 1024).
fn parse_size(s: &str) -> Result<usize> {
    let s = s.trim();
    let (num, mult) = match s.chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&s[..s.len() - 1], 1usize << 10),
        Some('M') => (&s[..s.len() - 1], 1 << 20),
        Some('G') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| Error::invalid(format!("bad size {s:?}")))
}

/// The number a flag takes.
fn number<T: FromStr>(flag: &str, value: &str) -> Result<T> {
    value
        .parse()
        .map_err(|_| Error::invalid(format!("{flag} takes a number")))
}

/// `--tokens`: numbers, comma separated.
fn parse_tokens(s: &str) -> Result<Vec<usize>> {
    s.split(',')
        .map(|t| t.trim().parse().map_err(|_| Error::invalid("--tokens takes numbers")))
        .collect()
}

/// `--quantization`: codecs, comma separated (`none` is left out).
fn parse_quantization(s: &str) -> Result<Vec<Quantization>> {
    s.split(',')
        .map(str::parse)
        .filter(|q| q.as_ref().map_or(true, |q| *q != Quantization::None))
        .collect()
}

/// Names out of `all` (each named by `name`), comma separated, or `all`
/// for every one; `unknown` is the error of a name that is none of them.
fn pick<T: Copy>(
    s: &str,
    all: &[T],
    name: impl Fn(T) -> &'static str,
    unknown: impl Fn(&str) -> Error,
) -> Result<Vec<T>> {
    if s == "all" {
        return Ok(all.to_vec());
    }
    s.split(',')
        .map(|x| {
            all.iter()
                .copied()
                .find(|&c| name(c) == x.trim())
                .ok_or_else(|| unknown(x))
        })
        .collect()
}

/// `--coll`: collectives by name, or `all`.
fn parse_colls(s: &str) -> Result<Vec<Coll>> {
    pick(s, &Coll::ALL, Coll::name, |x| {
        Error::invalid(format!("unknown --coll {x:?}"))
    })
}

/// `--fused` patterns: names as `FusionPattern::name`, or `all`.
fn parse_patterns(s: &str) -> Result<Vec<FusionPattern>> {
    pick(s, &FusionPattern::ALL, FusionPattern::name, |x| {
        Error::invalid(format!(
            "unknown --fused pattern {x:?} (res, rms, rms_fp8, rms_fp8tok, rms_i8tok, all)"
        ))
    })
}

/// `--fused-sp`: output forms by `SpOutput::name`, or `all`.
fn parse_sp(s: &str) -> Result<Vec<SpOutput>> {
    pick(s, &SpOutput::ALL, SpOutput::name, |x| {
        Error::invalid(format!("unknown --fused-sp form {x:?} (gathered, shard, all)"))
    })
}

/// `--sf-layout`: one of NVFP4's scale-factor layouts.
fn parse_sf_layout(s: &str) -> Result<SfLayout> {
    SfLayout::ALL
        .into_iter()
        .find(|l| l.name() == s.trim())
        .ok_or_else(|| Error::invalid(format!("unknown --sf-layout {s:?} (swizzled, linear)")))
}

/// `--fused-moe`: top-k values, each 1 to `MOE_MAX_TOPK`.
fn parse_topks(s: &str) -> Result<Vec<usize>> {
    let max = ferrocomm::MOE_MAX_TOPK;
    s.split(',')
        .map(|x| match x.trim().parse::<usize>() {
            Ok(k) if (1..=max).contains(&k) => Ok(k),
            _ => Err(Error::invalid(format!(
                "--fused-moe takes top-k values 1 to {max}, not {x:?}"
            ))),
        })
        .collect()
}

/// `--operands`: `plain`, `heap` or `both` (plain, then heap).
fn parse_operands(s: &str) -> Result<Vec<Operands>> {
    match s.trim() {
        "plain" => Ok(vec![Operands::Plain]),
        "heap" => Ok(vec![Operands::Heap]),
        "both" => Ok(vec![Operands::Plain, Operands::Heap]),
        other => Err(Error::invalid(format!(
            "--operands {other:?} is not one of plain, heap, both"
        ))),
    }
}
