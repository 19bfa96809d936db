//! What the NVRTC and clang compile checks (`tests/kernels_cuda_compile.rs`,
//! `tests/kernels_hip_compile.rs`) share: the device API's sources with the
//! probe that calls every function, the ABI checks compiled after each text,
//! and how a check collects its failures.
//! How to compile and what to read from the object stays in each check.

/// The CUDA prelude, which the HIP check compares its own prelude against.
pub const CUDA_PRELUDE: &str = include_str!("../../kernels-cuda/prelude.cuh");
pub const DEVICE_API: &str = include_str!("../../kernels-cuda/device_api.cuh");
pub const USER_ALLGATHER: &str = include_str!("../../kernels-cuda/examples/user_allgather.cu");
pub const PUT_BENCH: &str = include_str!("../../kernels-cuda/examples/put_bench.cu");
pub const UNFUSED_BENCH: &str = include_str!("../../kernels-cuda/examples/unfused_bench.cu");
pub const WINDOWS: &str = include_str!("../../kernels-cuda/windows.cu");
/// The EP module's kernels (src/ep), compiled as the module is: prelude + API
/// + lamport.cuh + ep.cu.
pub const EP_KERNELS: &str = concat!(
    include_str!("../../kernels-cuda/lamport.cuh"),
    "\n",
    include_str!("../../kernels-cuda/ep.cu")
);

/// `text`, then the layout checks of every kernel ABI struct it declares
/// (`ferrocomm::device::abi`: a `static_assert` per field, from the Rust
/// struct): a C copy whose field differs from the Rust source in offset or
/// size fails the compile with a message naming the field.
pub fn with_abi_checks(text: String) -> String {
    let checks = ferrocomm::device::abi::c_checks_for(&text);
    text + "\n" + &checks
}

/// A kernel that calls every function of the device API once, so every
/// template is instantiated (and on CUDA every inline PTX path reaches ptxas).
const DEVICE_API_PROBE: &str = r#"
struct FcProbeArgs {
    FcDevCtx ctx;
    fc_u64 buf;  // heap
    fc_u64 sig;  // heap u64[8]
    fc_u64 out;  // u64 per thread
};
FC_HEAP_KERNEL(fc_devapi_probe, FcProbeArgs) {
    const FcDevCtx& ctx = a.ctx;
    char* buf = fc_ptr<char>(a.buf);
    fc_u64* sig = fc_ptr<fc_u64>(a.sig);
    const fc_u32 peer = (ctx.rank + 1u) % ctx.world;
    fc_u64 acc = fc_peer_ok(ctx, peer) + fc_in_heap(ctx, buf, 64);
    acc += reinterpret_cast<fc_u64>(fc_remote_ptr(ctx, peer, sig));
    fc_put_thread(ctx, peer, buf, buf + 4096, 33);
    fc_put_warp(ctx, peer, buf + 64, buf + 4097, 1000);
    fc_put_block(ctx, peer, buf + 2048, buf + 8192, 3000);
    fc_get_thread(ctx, peer, buf + 16384, buf, 17);
    fc_get_warp(ctx, peer, buf + 16384 + 3, buf + 7, 999);
    fc_get_block(ctx, peer, buf + 20480, buf + 2048, 4001);
    fc_put_signal_thread(ctx, peer, buf, buf + 4096, 17, sig, 1, FC_SIGNAL_ADD);
    fc_put_signal_warp(ctx, peer, buf + 64, buf + 4096, 100, sig + 1, 2, FC_SIGNAL_SET);
    fc_put_signal_block(ctx, peer, buf + 256, buf + 4096, 4096, sig + 2, 3, FC_SIGNAL_ADD);
    fc_signal_set(ctx, peer, sig + 3, 5);
    fc_signal_add(ctx, peer, sig + 4, 1);
    fc_fence();
    fc_quiet();
    acc += fc_wait_until(ctx, sig, FC_CMP_GE, 1, peer);
    acc += fc_wait_until(ctx, sig + 1, FC_CMP_EQ, 2, peer);
    acc += fc_barrier_all_block(ctx);
    acc += fc_atomic_add(ctx, peer, sig + 5, 1);
    acc += fc_atomic_cas(ctx, peer, sig + 6, 0, 1);
    acc += fc_atomic_fetch(ctx, peer, sig + 7);
    fc_ptr<fc_u64>(a.out)[fc_block_id() * fc_block_threads() + fc_thread_id()] = acc;
}
"#;

/// A user's source on the device API, and a kernel its object must export.
pub struct DeviceApiSource {
    /// The file stem; each check adds its extension.
    pub name: &'static str,
    pub defines: &'static str,
    pub user: &'static str,
    pub entry: &'static str,
}

impl DeviceApiSource {
    pub const fn new(name: &'static str, user: &'static str, entry: &'static str) -> Self {
        DeviceApiSource {
            name,
            defines: "",
            user,
            entry,
        }
    }

    /// The text ferrocomm compiles at run time for it (prelude + API + the
    /// user's source), so the check compiles what users get.
    pub fn text(&self, prelude: &str) -> String {
        format!("{}{prelude}\n{DEVICE_API}\n{}", self.defines, self.user)
    }
}

/// What both vendors compile on the device API: the probe, also with
/// `FC_DEVICE_API_CHECKS` (the address checks are compiled out otherwise),
/// the examples, windows and EP.
pub const DEVICE_API_SOURCES: [DeviceApiSource; 7] = [
    DeviceApiSource::new("device_api_probe", DEVICE_API_PROBE, "fc_devapi_probe"),
    DeviceApiSource {
        defines: "#define FC_DEVICE_API_CHECKS 1\n",
        ..DeviceApiSource::new("device_api_probe_checks", DEVICE_API_PROBE, "fc_devapi_probe")
    },
    DeviceApiSource::new("user_allgather", USER_ALLGATHER, "user_allgather"),
    DeviceApiSource::new("put_bench", PUT_BENCH, "put_bench"),
    DeviceApiSource::new("unfused_bench", UNFUSED_BENCH, "fcb_add_rms_norm_bf16"),
    DeviceApiSource::new("windows", WINDOWS, "fc_win_wait"),
    DeviceApiSource::new("ep", EP_KERNELS, "fc_ep_dispatch"),
];

/// A check's failures, asserted at the end so that one run lists them all.
pub struct Failures {
    allow_spills: bool,
    messages: Vec<String>,
}

impl Failures {
    /// `allow_spills`: `FERROCOMM_ALLOW_SPILLS`, as the check reads its flags.
    pub fn new(allow_spills: bool) -> Self {
        Failures {
            allow_spills,
            messages: Vec::new(),
        }
    }

    pub fn push(&mut self, message: String) {
        self.messages.push(message);
    }

    /// A kernel that spills fails the check unless spills are allowed: then
    /// it is only a warning, for trying out a change before tuning it.
    pub fn spill(&mut self, message: String) {
        if self.allow_spills {
            println!("warning: {message}");
        } else {
            self.push(format!("{message}; set FERROCOMM_ALLOW_SPILLS=1 to accept"));
        }
    }

    pub fn is_empty(&self) -> bool {
        self.messages.is_empty()
    }

    pub fn assert_none(&self) {
        assert!(self.messages.is_empty(), "{}", self.messages.join("\n"));
    }
}
