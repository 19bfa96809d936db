//! The kernel modules ferrocomm embeds, and the names of their entry points.
//! Sources are text compiled at run time (NVRTC / hipRTC) for the device's
//! arch; the host backend runs Rust twins looked up by the same names.

use crate::device::ModuleSource;
use crate::dtype::{DType, ReduceOp};

/// The vendor prelude (primitives) is prepended to each algorithm body, so the
/// body is written once and compiles for both vendors.
pub const COLLECTIVES: ModuleSource = ModuleSource {
    name: "collectives",
    cuda: concat!(
        include_str!("../../kernels-cuda/prelude.cuh"),
        "\n",
        include_str!("../../kernels-cuda/collectives.cu")
    ),
    hip: concat!(
        include_str!("../../kernels-hip/prelude.hip.h"),
        "\n",
        include_str!("../../kernels-cuda/collectives.cu")
    ),
};

/// Every module, for compile checks.
pub const ALL_MODULES: &[ModuleSource] = &[COLLECTIVES];

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
        }
    }

    /// Every kind, in a fixed order.
    pub const ALL: [KernelKind; 6] = [
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

/// Every entry point a collectives module must export: each kind for every
/// supported (dtype, op) pair, and broadcast once per dtype.
pub fn all_kernel_names() -> Vec<String> {
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
