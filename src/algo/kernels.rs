//! The kernel modules ferrocomm embeds, and the names of their entry points.
//! Sources are text compiled at run time (NVRTC / hipRTC) for the device's
//! arch; the host backend runs Rust twins looked up by the same names.

use crate::codec::{Codec, Fp8Flavor};
use crate::device::ModuleSource;
use crate::dtype::{DType, ReduceOp};

/// A module's text: the vendor prelude (primitives), the shared device code
/// (`lamport.cuh`, `common.cuh`), then the module's templates, so every body is written once
/// and compiles for both vendors. The entry points are not in the text: Rust
/// generates them ([`ModuleSource::text`]), so one compile can hold any subset
/// of a module's kernels (one kernel, compiled on first use, is what makes a
/// cold start take seconds instead of the whole module's half minute).
macro_rules! module_text {
    ($prelude:literal, $body:literal) => {
        concat!(
            include_str!($prelude),
            "\n",
            include_str!("../../kernels-cuda/lamport.cuh"),
            "\n",
            include_str!("../../kernels-cuda/common.cuh"),
            "\n",
            include_str!($body)
        )
    };
}

/// All-reduce (one-shot, two-shot, push, LL), broadcast, and the exchange
/// and reduce-to protocols (all-gather, gather, scatter, all-to-all(-v),
/// reduce-scatter, reduce).
pub const COLLECTIVES: ModuleSource = ModuleSource {
    name: "collectives",
    cuda: module_text!("../../kernels-cuda/prelude.cuh", "../../kernels-cuda/collectives.cu"),
    hip: module_text!("../../kernels-hip/prelude.hip.h", "../../kernels-cuda/collectives.cu"),
    kernels: collective_kernel_names,
    entry: collective_entry,
};

/// Quick-reduce (quantized two-shot) and its codec. A module of its own, so
/// communicators that never quantize never compile it.
pub const QUICK_REDUCE: ModuleSource = ModuleSource {
    name: "quickreduce",
    cuda: module_text!("../../kernels-cuda/prelude.cuh", "../../kernels-cuda/quickreduce.cu"),
    hip: module_text!("../../kernels-hip/prelude.hip.h", "../../kernels-cuda/quickreduce.cu"),
    kernels: quick_reduce_kernel_names,
    entry: quick_reduce_entry,
};

/// Fused all-reduce epilogues (residual add, RMSNorm, quantization;
/// `src/algo/fused.rs`). A module of its own, compiled on first use.
pub const FUSED: ModuleSource = ModuleSource {
    name: "fused",
    cuda: module_text!("../../kernels-cuda/prelude.cuh", "../../kernels-cuda/fused.cu"),
    hip: module_text!("../../kernels-hip/prelude.hip.h", "../../kernels-cuda/fused.cu"),
    kernels: super::fused::fused_kernel_names,
    entry: super::fused::fused_entry,
};

/// Every module, for compile checks.
#[cfg(any(test, feature = "testing"))]
pub const ALL_MODULES: &[ModuleSource] = &[COLLECTIVES, QUICK_REDUCE, FUSED];

/// The device-code element type of a reducible dtype (`common.cuh`).
fn device_type(dtype: DType) -> Option<&'static str> {
    match dtype {
        DType::F32 => Some("fc::TF32"),
        DType::F16 => Some("fc::TF16"),
        DType::BF16 => Some("fc::TBF16"),
        DType::I32 => Some("fc::TI32"),
        _ => None,
    }
}

/// The device-code op constant (`prelude.cuh`).
fn device_op(op: ReduceOp) -> &'static str {
    match op {
        ReduceOp::Sum => "FC_OP_SUM",
        ReduceOp::Prod => "FC_OP_PROD",
        ReduceOp::Min => "FC_OP_MIN",
        ReduceOp::Max => "FC_OP_MAX",
        ReduceOp::Avg => "FC_OP_AVG",
        ReduceOp::BAnd => "FC_OP_BAND",
        ReduceOp::BOr => "FC_OP_BOR",
        ReduceOp::BXor => "FC_OP_BXOR",
        ReduceOp::PreMulSum => "FC_OP_PREMUL",
    }
}

/// Parse `fc_<kind>_<dtype>_<op>` back, for every name the module exports.
fn parse_collective(name: &str) -> Option<(KernelKind, DType, ReduceOp)> {
    for kind in KernelKind::EXCHANGES {
        if name == kernel_name(kind, DType::U8, ReduceOp::Sum) {
            return Some((kind, DType::U8, ReduceOp::Sum));
        }
    }
    for dtype in DType::REDUCIBLE {
        for op in REDUCE_TO_OPS.into_iter().filter(|&op| dtype.supports(op)) {
            for kind in [KernelKind::ReduceTo, KernelKind::ReduceToDirect] {
                if kernel_name(kind, dtype, op) == name {
                    return Some((kind, dtype, op));
                }
            }
        }
        for op in KERNEL_OPS.into_iter().filter(|&op| dtype.supports(op)) {
            if kernel_name(KernelKind::ReduceToLl, dtype, op) == name {
                return Some((KernelKind::ReduceToLl, dtype, op));
            }
        }
        for kind in KernelKind::COLLECTIVES {
            for op in KERNEL_OPS {
                if (kind == KernelKind::Broadcast || dtype.supports(op)) && kernel_name(kind, dtype, op) == name {
                    return Some((kind, dtype, op));
                }
            }
        }
    }
    None
}

/// The C++ definition of one entry point of [`COLLECTIVES`].
pub fn collective_entry(name: &str) -> Option<String> {
    let (kind, dtype, op) = parse_collective(name)?;
    if KernelKind::EXCHANGES.contains(&kind) {
        // Bytes of any dtype: the element size comes from `FcParams::dtype`.
        return Some(format!("FC_KERNEL({name}) {{ fc::{}(p); }}\n", kind.name()));
    }
    let ty = device_type(dtype)?;
    let call = match kind {
        KernelKind::Broadcast => format!("fc::broadcast<{}>(p)", dtype.size()),
        KernelKind::OneShot => format!("fc::oneshot<{ty}, {}>(p)", device_op(op)),
        KernelKind::TwoShot => format!("fc::twoshot<{ty}, {}>(p)", device_op(op)),
        KernelKind::OneShotPush => format!("fc::oneshot_push<{ty}, {}>(p)", device_op(op)),
        KernelKind::OneShotLl => format!("fc::oneshot_ll<{ty}, {}>(p)", device_op(op)),
        KernelKind::TwoShotPush => format!("fc::twoshot_push<{ty}, {}>(p)", device_op(op)),
        KernelKind::ReduceTo => format!("fc::reduce_to<{ty}, {}>(p)", device_op(op)),
        KernelKind::ReduceToDirect => format!("fc::reduce_to_direct<{ty}, {}>(p)", device_op(op)),
        KernelKind::ReduceToLl => format!("fc::reduce_to_ll<{ty}, {}>(p)", device_op(op)),
        KernelKind::QuickReduce
        | KernelKind::Exchange
        | KernelKind::ExchangeDirect
        | KernelKind::ExchangeLl
        | KernelKind::SendRecv
        | KernelKind::Copy => return None,
    };
    Some(format!("FC_KERNEL({name}) {{ {call}; }}\n"))
}

/// The device-code codec constant (`quickreduce.cu`).
fn device_codec(codec: Codec) -> &'static str {
    match codec {
        Codec::Fp8(Fp8Flavor::E4m3Fn) => "FC_QR_FP8",
        Codec::Fp8(Fp8Flavor::E4m3Fnuz) => "FC_QR_FP8FNUZ",
        Codec::Int8 => "FC_QR_INT8",
        Codec::Int6 => "FC_QR_INT6",
        Codec::Int4 => "FC_QR_INT4",
        Codec::Fp4 => "FC_QR_FP4",
    }
}

/// The C++ definition of one entry point of [`QUICK_REDUCE`].
pub fn quick_reduce_entry(name: &str) -> Option<String> {
    for codec in QR_CODECS {
        for dtype in QR_DTYPES {
            let (c, ty) = (device_codec(codec), device_type(dtype)?);
            if quick_reduce_name(codec, dtype) == name {
                return Some(format!("FC_KERNEL({name}) {{ fc::quickreduce<{c}, {ty}>(p); }}\n"));
            }
            if qr_encode_name(codec, dtype) == name {
                return Some(format!("FC_KERNEL({name}) {{ fc::qr_encode_run<{c}, {ty}>(p); }}\n"));
            }
        }
    }
    None
}

/// The ops ferrocomm's all-reduce kernels implement. premul_sum is reduced
/// by the host reference and the reduce-to kernels ([`REDUCE_TO_OPS`]);
/// a GPU all-reduce with it goes to NCCL/RCCL.
pub const KERNEL_OPS: [ReduceOp; 8] = ReduceOp::OPERATORS;

/// The ops of the reduce-to kernels: the all-reduce kernels' and premul_sum
/// (each source scaled by its own factor, published at phase 0).
pub const REDUCE_TO_OPS: [ReduceOp; 9] = ReduceOp::ALL;

/// Which collective kernel family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KernelKind {
    /// One-shot, pull: stage in own slot, every rank reads every peer's slot.
    OneShot,
    /// Two-shot, pull: reduce-scatter and all-gather by reading peers' slots.
    TwoShot,
    Broadcast,
    /// One-shot, push: write own input into every rank's workspace, flag, reduce locally.
    OneShotPush,
    /// One-shot, LL (barrier-free): data pushed with the epoch embedded in
    /// every 8-byte unit, so no separate flag or fence.
    OneShotLl,
    /// Two-shot, push: push pieces to their owners, reduce locally, push results back.
    TwoShotPush,
    /// Quick-reduce: two-shot push with quantized payloads (module
    /// [`QUICK_REDUCE`]; the codec is part of the kernel's name).
    QuickReduce,
    /// Every rank sends a block to some peers and receives one from some:
    /// all-gather, gather, scatter and all-to-all(-v), with per-peer counts and
    /// addresses (`KernelParams::per_peer`). `fc_exchange` on every backend
    /// (GPUs may route to NCCL/RCCL instead: `comm::route`).
    Exchange,
    /// The exchange writing straight into the receivers' blocks when every
    /// rank's lie in its symmetric heap (zero copy: no inbox, no chunks, one
    /// more flag round trip); else, decided the same on every rank after the
    /// first flags, the exchange. `fc_exchange_direct`.
    ExchangeDirect,
    /// The exchange for small messages on LL lines (the data carries the
    /// epoch, as in [`KernelKind::OneShotLl`]; no inbox, flags or chunks)
    /// when every non-empty block is the call's agreed size and fits one
    /// source's lines: all-gather, gather, scatter, all-to-all without
    /// splits. `fc_exchange_ll`.
    ExchangeLl,
    /// Every rank sends a block to some peers, and each receiver reduces
    /// what it receives (its own block included) in rank order:
    /// reduce-scatter and reduce. `fc_reduce_to_<dtype>_<op>` on every
    /// backend (GPUs may route to NCCL/RCCL instead: `comm::route`).
    ReduceTo,
    /// The reduce-to reading every source's block in place when every
    /// rank's blocks to peers lie in its symmetric heap (zero copy: no inbox,
    /// no chunks, one more flag round trip); else, decided the same on every
    /// rank after the first flags, the reduce-to. `fc_reduce_to_direct_<dtype>_<op>`.
    ReduceToDirect,
    /// The reduce-to for small messages on LL lines (as
    /// [`KernelKind::ExchangeLl`]; every op but premul_sum):
    /// reduce-scatter, reduce. `fc_reduce_to_ll_<dtype>_<op>`.
    ReduceToLl,
    /// A batch of sends and receives between pairs, with per-pair sequence
    /// numbers instead of the group's epochs. Host protocol; GPUs use NCCL.
    SendRecv,
    /// The copy route (all-gather, broadcast, all-to-all): the copy engines
    /// move the data (`Device::copy_device` into the peers' mapped
    /// workspaces), and `fc_copy_sync`, one block that moves no data, is the
    /// handshake around the copies (`algo::copy`, docs/protocol.md "Copy route").
    Copy,
}

impl KernelKind {
    pub const fn name(self) -> &'static str {
        match self {
            KernelKind::OneShot => "oneshot",
            KernelKind::TwoShot => "twoshot",
            KernelKind::Broadcast => "broadcast",
            KernelKind::OneShotPush => "oneshot_push",
            KernelKind::OneShotLl => "oneshot_ll",
            KernelKind::TwoShotPush => "twoshot_push",
            KernelKind::QuickReduce => "qr",
            KernelKind::Exchange => "exchange",
            KernelKind::ExchangeDirect => "exchange_direct",
            KernelKind::ExchangeLl => "exchange_ll",
            KernelKind::ReduceTo => "reduce_to",
            KernelKind::ReduceToDirect => "reduce_to_direct",
            KernelKind::ReduceToLl => "reduce_to_ll",
            KernelKind::SendRecv => "sendrecv",
            KernelKind::Copy => "copy_sync",
        }
    }

    /// The protocols of the collectives beyond all-reduce and broadcast,
    /// with per-peer lists (the host module has them all; the GPU modules
    /// have exchange and reduce-to; send/recv goes to NCCL/RCCL on GPUs).
    pub const HOST_PROTOCOLS: [KernelKind; 7] = [
        KernelKind::Exchange,
        KernelKind::ExchangeDirect,
        KernelKind::ExchangeLl,
        KernelKind::ReduceTo,
        KernelKind::ReduceToDirect,
        KernelKind::ReduceToLl,
        KernelKind::SendRecv,
    ];

    /// The kinds that move bytes of any dtype from per-peer lists
    /// (`fc_<kind>`, one entry point each).
    pub const EXCHANGES: [KernelKind; 4] = [
        KernelKind::Exchange,
        KernelKind::ExchangeDirect,
        KernelKind::ExchangeLl,
        KernelKind::Copy,
    ];

    /// Every kind, in a fixed order.
    pub const ALL: [KernelKind; 15] = [
        KernelKind::OneShot,
        KernelKind::TwoShot,
        KernelKind::Broadcast,
        KernelKind::OneShotPush,
        KernelKind::OneShotLl,
        KernelKind::TwoShotPush,
        KernelKind::QuickReduce,
        KernelKind::Exchange,
        KernelKind::ExchangeDirect,
        KernelKind::ExchangeLl,
        KernelKind::ReduceTo,
        KernelKind::ReduceToDirect,
        KernelKind::ReduceToLl,
        KernelKind::SendRecv,
        KernelKind::Copy,
    ];

    /// The kinds of the [`COLLECTIVES`] module.
    pub const COLLECTIVES: [KernelKind; 6] = [
        KernelKind::OneShot,
        KernelKind::TwoShot,
        KernelKind::Broadcast,
        KernelKind::OneShotPush,
        KernelKind::OneShotLl,
        KernelKind::TwoShotPush,
    ];

    /// The all-reduce kinds (every kind but broadcast).
    pub const REDUCE: [KernelKind; 5] = [
        KernelKind::OneShot,
        KernelKind::TwoShot,
        KernelKind::OneShotPush,
        KernelKind::OneShotLl,
        KernelKind::TwoShotPush,
    ];
}

/// `fc_<kind>_<dtype>_<op>`; broadcast always uses op `sum`; the kinds that
/// only move bytes (exchange, sendrecv) are `fc_<kind>`.
pub fn kernel_name(kind: KernelKind, dtype: DType, op: ReduceOp) -> String {
    match kind {
        KernelKind::Exchange
        | KernelKind::ExchangeDirect
        | KernelKind::ExchangeLl
        | KernelKind::SendRecv
        | KernelKind::Copy => {
            format!("fc_{}", kind.name())
        }
        KernelKind::Broadcast => format!("fc_{}_{}_sum", kind.name(), dtype.name()),
        _ => format!("fc_{}_{}_{}", kind.name(), dtype.name(), op.name()),
    }
}

/// The dtypes quick-reduce carries.
pub const QR_DTYPES: [DType; 2] = [DType::F16, DType::BF16];

/// Every codec quick-reduce kernels exist for (both FP8 flavours on every
/// vendor, so the CUDA and HIP modules export the same names).
pub const QR_CODECS: [Codec; 6] = [
    Codec::Fp8(Fp8Flavor::E4m3Fn),
    Codec::Fp8(Fp8Flavor::E4m3Fnuz),
    Codec::Int8,
    Codec::Int6,
    Codec::Int4,
    Codec::Fp4,
];

/// A codec's position in [`QR_CODECS`] (every codec has one).
pub fn qr_codec_index(codec: Codec) -> usize {
    QR_CODECS.iter().position(|&c| c == codec).unwrap_or(0)
}

/// `fc_qr_<codec>_<dtype>`: the quick-reduce all-reduce (sum).
pub fn quick_reduce_name(codec: Codec, dtype: DType) -> String {
    format!("fc_qr_{}_{}", codec.name(), dtype.name())
}

/// `fc_qr_encode_<codec>_<dtype>`: the codec alone, `count` elements of the
/// input encoded into the output as one run (for bit-exactness tests).
pub fn qr_encode_name(codec: Codec, dtype: DType) -> String {
    format!("fc_qr_encode_{}_{}", codec.name(), dtype.name())
}

/// Every entry point of the [`QUICK_REDUCE`] module.
pub fn quick_reduce_kernel_names() -> Vec<String> {
    let mut names = Vec::new();
    for codec in QR_CODECS {
        for dtype in QR_DTYPES {
            names.push(quick_reduce_name(codec, dtype));
            names.push(qr_encode_name(codec, dtype));
        }
    }
    names
}

/// Every entry point of every module ([`ALL_MODULES`]).
#[cfg(any(test, feature = "testing"))]
pub fn all_kernel_names() -> Vec<String> {
    let mut names = collective_kernel_names();
    names.extend(quick_reduce_kernel_names());
    names.extend(super::fused::fused_kernel_names());
    names
}

/// Every entry point the [`COLLECTIVES`] module exports: each kind for
/// every reducible dtype and kernel op it supports, broadcast once per
/// reducible dtype (it only moves bytes of that size), reduce-to and its
/// direct twin for every reducible dtype and [`REDUCE_TO_OPS`] op it
/// supports, its LL twin for every kernel op, and the exchanges
/// ([`KernelKind::EXCHANGES`], bytes of any dtype).
pub fn collective_kernel_names() -> Vec<String> {
    let mut names: Vec<String> = KernelKind::EXCHANGES
        .iter()
        .map(|&kind| kernel_name(kind, DType::U8, ReduceOp::Sum))
        .collect();
    for dtype in DType::REDUCIBLE {
        for kind in KernelKind::REDUCE {
            for op in KERNEL_OPS {
                if dtype.supports(op) {
                    names.push(kernel_name(kind, dtype, op));
                }
            }
        }
        for op in KERNEL_OPS.into_iter().filter(|&op| dtype.supports(op)) {
            names.push(kernel_name(KernelKind::ReduceToLl, dtype, op));
        }
        names.push(kernel_name(KernelKind::Broadcast, dtype, ReduceOp::Sum));
        for op in REDUCE_TO_OPS.into_iter().filter(|&op| dtype.supports(op)) {
            names.push(kernel_name(KernelKind::ReduceTo, dtype, op));
            names.push(kernel_name(KernelKind::ReduceToDirect, dtype, op));
        }
    }
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_has_an_entry_and_entries_call_the_named_template() {
        for module in ALL_MODULES {
            for name in (module.kernels)() {
                let entry = (module.entry)(&name).unwrap_or_else(|| panic!("{name} has no entry"));
                assert!(entry.starts_with(&format!("FC_KERNEL({name}) ")), "{entry}");
            }
            assert!((module.entry)("fc_no_such_kernel").is_none());
        }
        assert_eq!(
            collective_entry("fc_oneshot_ll_bf16_sum").unwrap(),
            "FC_KERNEL(fc_oneshot_ll_bf16_sum) { fc::oneshot_ll<fc::TBF16, FC_OP_SUM>(p); }\n"
        );
        assert_eq!(
            collective_entry("fc_broadcast_f16_sum").unwrap(),
            "FC_KERNEL(fc_broadcast_f16_sum) { fc::broadcast<2>(p); }\n"
        );
        assert!(collective_kernel_names().contains(&"fc_twoshot_push_i32_bxor".to_string()));
        // premul_sum: reduce-to kernels only (all-reduce sends it to NCCL/RCCL).
        let premul: Vec<String> = collective_kernel_names()
            .into_iter()
            .filter(|n| n.contains("premul"))
            .collect();
        assert_eq!(
            premul,
            ["f32", "f16", "bf16"]
                .into_iter()
                .flat_map(|d| [
                    format!("fc_reduce_to_{d}_premul_sum"),
                    format!("fc_reduce_to_direct_{d}_premul_sum")
                ])
                .collect::<Vec<_>>()
        );
        assert_eq!(
            collective_entry("fc_exchange").unwrap(),
            "FC_KERNEL(fc_exchange) { fc::exchange(p); }\n"
        );
        assert_eq!(
            collective_entry("fc_reduce_to_bf16_premul_sum").unwrap(),
            "FC_KERNEL(fc_reduce_to_bf16_premul_sum) { fc::reduce_to<fc::TBF16, FC_OP_PREMUL>(p); }\n"
        );
        assert_eq!(
            collective_entry("fc_reduce_to_direct_i32_bxor").unwrap(),
            "FC_KERNEL(fc_reduce_to_direct_i32_bxor) { fc::reduce_to_direct<fc::TI32, FC_OP_BXOR>(p); }\n"
        );
        assert!(collective_entry("fc_reduce_to_i32_avg").is_none());
        assert!(collective_entry("fc_reduce_to_direct_i32_avg").is_none());
        assert!(collective_entry("fc_sendrecv").is_none());
    }

    #[test]
    fn module_text_holds_only_the_asked_entries() {
        let one = COLLECTIVES
            .text(crate::device::BackendKind::Cuda, &["fc_oneshot_f32_sum"])
            .unwrap();
        assert!(one.contains("FC_KERNEL(fc_oneshot_f32_sum)"));
        assert!(!one.contains("FC_KERNEL(fc_twoshot_f32_sum)"));
        assert!(COLLECTIVES
            .text(crate::device::BackendKind::Hip, &["fc_bogus"])
            .is_err());
        let all = COLLECTIVES.full_text(crate::device::BackendKind::Cuda);
        assert_eq!(
            all.matches("FC_KERNEL(").count() - COLLECTIVES.cuda.matches("FC_KERNEL(").count(),
            collective_kernel_names().len()
        );
    }
}
