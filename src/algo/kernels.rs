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
    hip: "",
};

/// Every module, for compile checks.
pub const ALL_MODULES: &[ModuleSource] = &[COLLECTIVES];

/// Which collective kernel family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KernelKind {
    OneShot,
    TwoShot,
    Broadcast,
}

impl KernelKind {
    pub const fn name(self) -> &'static str {
        match self {
            KernelKind::OneShot => "oneshot",
            KernelKind::TwoShot => "twoshot",
            KernelKind::Broadcast => "broadcast",
        }
    }
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
        for kind in [KernelKind::OneShot, KernelKind::TwoShot] {
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
