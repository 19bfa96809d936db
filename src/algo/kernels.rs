//! The kernel modules ferrocomm embeds, and the names of their entry points.
//! Sources are text compiled at run time (NVRTC / hipRTC) for the device's
//! arch; the host backend runs Rust twins looked up by the same names.

use crate::codec::{Codec, Fp8Flavor};
use crate::device::ModuleSource;
use crate::dtype::{DType, ReduceOp};

/// A module's text: the vendor prelude (primitives), the shared device code
/// (`common.cuh`), then the module's kernels, so every body is written once
/// and compiles for both vendors.
macro_rules! module_text {
    ($prelude:literal, $body:literal) => {
        concat!(
            include_str!($prelude),
            "\n",
            include_str!("../../kernels-cuda/common.cuh"),
            "\n",
            include_str!($body)
        )
    };
}

/// All-reduce (one-shot, two-shot, push, LL) and broadcast.
pub const COLLECTIVES: ModuleSource = ModuleSource {
    name: "collectives",
    cuda: module_text!("../../kernels-cuda/prelude.cuh", "../../kernels-cuda/collectives.cu"),
    hip: module_text!("../../kernels-hip/prelude.hip.h", "../../kernels-cuda/collectives.cu"),
};

/// Quick-reduce (quantized two-shot) and its codec. A module of its own, so
/// communicators that never quantize never compile it.
pub const QUICK_REDUCE: ModuleSource = ModuleSource {
    name: "quickreduce",
    cuda: module_text!("../../kernels-cuda/prelude.cuh", "../../kernels-cuda/quickreduce.cu"),
    hip: module_text!("../../kernels-hip/prelude.hip.h", "../../kernels-cuda/quickreduce.cu"),
};

/// Every module, for compile checks.
pub const ALL_MODULES: &[ModuleSource] = &[COLLECTIVES, QUICK_REDUCE];

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
        }
    }

    /// Every kind, in a fixed order.
    pub const ALL: [KernelKind; 7] = [
        KernelKind::OneShot,
        KernelKind::TwoShot,
        KernelKind::Broadcast,
        KernelKind::OneShotPush,
        KernelKind::OneShotLl,
        KernelKind::TwoShotPush,
        KernelKind::QuickReduce,
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

/// `fc_<kind>_<dtype>_<op>`; broadcast always uses op `sum`.
pub fn kernel_name(kind: KernelKind, dtype: DType, op: ReduceOp) -> String {
    let op = if kind == KernelKind::Broadcast {
        ReduceOp::Sum
    } else {
        op
    };
    format!("fc_{}_{}_{}", kind.name(), dtype.name(), op.name())
}

/// The dtypes quick-reduce carries.
pub const QR_DTYPES: [DType; 2] = [DType::F16, DType::BF16];

/// Every codec quick-reduce kernels exist for (both FP8 flavours on every
/// vendor, so the CUDA and HIP modules export the same names).
pub const QR_CODECS: [Codec; 5] = [
    Codec::Fp8(Fp8Flavor::E4m3Fn),
    Codec::Fp8(Fp8Flavor::E4m3Fnuz),
    Codec::Int8,
    Codec::Int6,
    Codec::Int4,
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
pub fn all_kernel_names() -> Vec<String> {
    let mut names = collective_kernel_names();
    names.extend(quick_reduce_kernel_names());
    names
}

/// Every entry point the [`COLLECTIVES`] module must export: each kind for
/// every supported (dtype, op) pair, and broadcast once per dtype.
pub fn collective_kernel_names() -> Vec<String> {
    let mut names = Vec::new();
    for dtype in DType::ALL {
        for kind in KernelKind::REDUCE {
            for op in ReduceOp::ALL {
                if dtype.supports(op) {
                    names.push(kernel_name(kind, dtype, op));
                }
            }
        }
        names.push(kernel_name(KernelKind::Broadcast, dtype, ReduceOp::Sum));
    }
    names
}
