//! A vendor table with no hardware behind it, for testing the shared GPU
//! layer where there is no GPU (CI): device memory is a map of address
//! ranges, streams remember whether they capture, the "compiler" takes a
//! while and fails on `this_is_not_defined`, and every module load, compile
//! and launch is recorded with the thread that did it.

use std::collections::{HashMap, HashSet};
use std::ffi::{c_void, CStr};
use std::os::fd::OwnedFd;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::thread::ThreadId;
use std::time::Duration;

use super::errors::DropErrors;
use super::handle::{HandleKind, ParsedHandle};
use super::vendor::{
    sealed, CompileTarget, Driver, Export, ImageKind, Ipc, MemoryType, Opened, PointerInfo, RawEvent, RawFunction,
    RawGraph, RawGraphExec, RawModule, RawStream, Rtc,
};
use crate::device::{BackendKind, DeviceFacts, DevicePtr, KernelParams, LaunchConfig};
use crate::error::{Error, Result};

/// The fake vendor (it poses as HIP, whose handles are address-based).
pub struct Fake;

impl sealed::Sealed for Fake {}

pub struct FakeCtx {
    ordinal: usize,
}

/// What the fake driver saw.
#[derive(Default)]
pub struct Log {
    /// Live allocations: address -> (device, size).
    pub memory: HashMap<u64, (usize, usize)>,
    pub capturing: HashSet<u64>,
    /// Loaded modules: handle -> image.
    pub modules: HashMap<u64, Vec<u8>>,
    pub compiles: Vec<(String, ThreadId)>,
    pub loads: Vec<ThreadId>,
    /// Kernel names launched, in order.
    pub launches: Vec<String>,
    /// Every launch with its grid and parameter block, in order.
    pub launched: Vec<(String, LaunchConfig, KernelParams)>,
    pub functions: HashMap<u64, String>,
}

pub fn log() -> MutexGuard<'static, Log> {
    static LOG: OnceLock<Mutex<Log>> = OnceLock::new();
    LOG.get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

fn next_handle() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(0x10_0000);
    // Allocations are 1 MiB apart with a gap, so ranges never touch.
    NEXT.fetch_add(0x40_0000, Ordering::Relaxed)
}

/// How long one fake compile takes.
pub const COMPILE_TIME: Duration = Duration::from_millis(40);

static DROPS: DropErrors = DropErrors::new();

impl Driver for Fake {
    const KIND: BackendKind = BackendKind::Hip;
    const LABEL: &'static str = "FAKE";
    type Context = FakeCtx;
    type Extra = ();

    fn drop_errors() -> &'static DropErrors {
        &DROPS
    }
    fn device_count() -> Result<usize> {
        Ok(2)
    }
    fn open(ordinal: usize) -> Result<Opened<Fake>> {
        if ordinal >= 2 {
            return Err(Error::NoDevice {
                backend: "fake",
                reason: "two fake devices".into(),
            });
        }
        Ok(Opened {
            ctx: Arc::new(FakeCtx { ordinal }),
            facts: DeviceFacts {
                backend: BackendKind::Hip,
                ordinal,
                name: "fake".into(),
                arch: "fake1".into(),
                multiprocessors: 4,
                warp_size: 64,
                total_memory: 1 << 30,
            },
            map_host: true,
            extra: (),
        })
    }
    fn bind(_: &FakeCtx) -> Result<()> {
        Ok(())
    }
    fn ordinal(ctx: &FakeCtx) -> usize {
        ctx.ordinal
    }
    fn context_id(ctx: &FakeCtx) -> u64 {
        ctx.ordinal as u64
    }
    fn can_access_peer(_: usize, _: usize) -> Result<bool> {
        Ok(true)
    }
    fn enable_peer_access(_: &FakeCtx, _: usize) -> Result<()> {
        Ok(())
    }
    fn relax_thread_capture_mode() {}
    fn runtime_info() -> String {
        "fake driver".into()
    }
    fn mem_info(_: &FakeCtx) -> Result<(usize, usize)> {
        let used: usize = log().memory.values().map(|&(_, b)| b).sum();
        Ok(((1usize << 30).saturating_sub(used), 1 << 30))
    }
    fn mem_alloc(ctx: &FakeCtx, bytes: usize) -> Result<DevicePtr> {
        let a = next_handle();
        log().memory.insert(a, (ctx.ordinal, bytes));
        Ok(DevicePtr(a))
    }
    unsafe fn mem_free(_: &FakeCtx, ptr: DevicePtr) -> Result<()> {
        log().memory.remove(&ptr.0);
        Ok(())
    }
    fn host_alloc_mapped(_: &FakeCtx, bytes: usize) -> Result<(NonNull<u8>, DevicePtr)> {
        let words = vec![0u64; bytes.div_ceil(8)].into_boxed_slice();
        let p = NonNull::new(Box::into_raw(words) as *mut u8).ok_or_else(|| Error::invalid("null"))?;
        Ok((p, DevicePtr(p.as_ptr() as u64)))
    }
    unsafe fn host_free(_: &FakeCtx, _: NonNull<u8>) -> Result<()> {
        // Leaked: tests allocate a few words.
        Ok(())
    }
    unsafe fn memset_async(_: &FakeCtx, _: DevicePtr, _: u8, _: usize, _: RawStream) -> Result<()> {
        Ok(())
    }
    unsafe fn copy_to_device_async(_: &FakeCtx, _: DevicePtr, _: *const u8, _: usize, _: RawStream) -> Result<()> {
        Ok(())
    }
    unsafe fn copy_to_host_async(_: &FakeCtx, _: *mut u8, _: DevicePtr, _: usize, _: RawStream) -> Result<()> {
        Ok(())
    }
    unsafe fn copy_device_async(_: &FakeCtx, _: DevicePtr, _: DevicePtr, _: usize, _: RawStream) -> Result<()> {
        Ok(())
    }
    fn pointer_info(_: &FakeCtx, ptr: DevicePtr) -> Result<Option<PointerInfo>> {
        let device = log()
            .memory
            .iter()
            .find(|(a, (_, s))| ptr.0 >= **a && ptr.0 < **a + *s as u64)
            .map(|(_, (d, _))| *d);
        Ok(Some(PointerInfo {
            memory: if device.is_some() {
                MemoryType::Device
            } else {
                MemoryType::Unknown
            },
            device,
            pooled: false,
            vmm: false,
            range: None,
        }))
    }
    fn address_range(_: &FakeCtx, ptr: DevicePtr) -> Result<Option<(DevicePtr, usize)>> {
        Ok(log()
            .memory
            .iter()
            .find(|(a, (_, s))| ptr.0 >= **a && ptr.0 < **a + *s as u64)
            .map(|(a, (_, s))| (DevicePtr(*a), *s)))
    }
    fn stream_create(_: &FakeCtx) -> Result<RawStream> {
        Ok(RawStream(next_handle()))
    }
    unsafe fn stream_destroy(_: &FakeCtx, _: RawStream) -> Result<()> {
        Ok(())
    }
    unsafe fn stream_synchronize(_: &FakeCtx, _: RawStream) -> Result<()> {
        Ok(())
    }
    unsafe fn stream_is_capturing(_: &FakeCtx, s: RawStream) -> Result<bool> {
        Ok(log().capturing.contains(&s.0))
    }
    unsafe fn stream_check_owner(_: &FakeCtx, s: RawStream) -> Result<()> {
        if s.0 == 0xbad {
            return Err(Error::invalid("another device's stream"));
        }
        Ok(())
    }
    unsafe fn stream_wait_event(_: &FakeCtx, _: RawStream, _: RawEvent) -> Result<()> {
        Ok(())
    }
    unsafe fn begin_capture(_: &FakeCtx, s: RawStream) -> Result<()> {
        log().capturing.insert(s.0);
        Ok(())
    }
    unsafe fn end_capture(_: &FakeCtx, s: RawStream) -> Result<RawGraph> {
        if !log().capturing.remove(&s.0) {
            return Err(Error::invalid("end_capture on a stream that is not capturing"));
        }
        Ok(RawGraph(next_handle()))
    }
    unsafe fn graph_instantiate(_: &FakeCtx, _: RawGraph) -> Result<RawGraphExec> {
        Ok(RawGraphExec(next_handle()))
    }
    unsafe fn graph_launch(_: &FakeCtx, _: RawGraphExec, _: RawStream) -> Result<()> {
        Ok(())
    }
    unsafe fn graph_exec_destroy(_: &FakeCtx, _: RawGraphExec) -> Result<()> {
        Ok(())
    }
    unsafe fn graph_destroy(_: &FakeCtx, _: RawGraph) -> Result<()> {
        Ok(())
    }
    fn event_create(_: &FakeCtx) -> Result<RawEvent> {
        Ok(RawEvent(next_handle()))
    }
    unsafe fn event_destroy(_: &FakeCtx, _: RawEvent) -> Result<()> {
        Ok(())
    }
    unsafe fn event_record(_: &FakeCtx, _: RawEvent, _: RawStream) -> Result<()> {
        Ok(())
    }
    unsafe fn event_query(_: &FakeCtx, _: RawEvent) -> Result<bool> {
        Ok(true)
    }
    unsafe fn event_elapsed_ms(_: &FakeCtx, _: RawEvent, _: RawEvent) -> Result<f32> {
        Ok(1.0)
    }
    fn module_load(_: &FakeCtx, image: &[u8]) -> Result<RawModule> {
        let h = next_handle();
        let mut l = log();
        l.loads.push(std::thread::current().id());
        l.modules.insert(h, image.to_vec());
        Ok(RawModule(h))
    }
    unsafe fn module_unload(_: &FakeCtx, m: RawModule) -> Result<()> {
        log().modules.remove(&m.0);
        Ok(())
    }
    unsafe fn module_function(_: &FakeCtx, m: RawModule, name: &CStr) -> Result<Option<RawFunction>> {
        let name = name.to_string_lossy().into_owned();
        let mut l = log();
        let image = l.modules.get(&m.0).ok_or_else(|| Error::invalid("no such module"))?;
        if !String::from_utf8_lossy(image).contains(&format!("FC_KERNEL({name})")) {
            return Ok(None);
        }
        let f = next_handle();
        l.functions.insert(f, name);
        Ok(Some(RawFunction(f)))
    }
    unsafe fn launch(
        _: &FakeCtx,
        f: RawFunction,
        config: LaunchConfig,
        args: &mut [*mut c_void; 1],
        _: RawStream,
    ) -> Result<()> {
        // SAFETY: every launch passes one pointer to a live KernelParams
        // (GpuDevice::launch), valid for this call.
        let params = unsafe { *(args[0] as *const KernelParams) };
        let mut l = log();
        let name = l.functions.get(&f.0).cloned().unwrap_or_default();
        l.launches.push(name.clone());
        l.launched.push((name, config, params));
        Ok(())
    }
}

impl Ipc for Fake {
    type Shared = (DevicePtr, usize);
    type Mapping = DevicePtr;

    fn alloc_shared(ctx: &Arc<FakeCtx>, bytes: usize) -> Result<(DevicePtr, usize)> {
        let size = bytes.max(1).next_multiple_of(2 << 20);
        Ok((Fake::mem_alloc(ctx, size)?, size))
    }
    fn shared_range(s: &(DevicePtr, usize)) -> (DevicePtr, usize) {
        *s
    }
    fn export_shared(_: &FakeCtx, s: &(DevicePtr, usize)) -> Result<Export> {
        Ok(Export {
            kind: HandleKind::HipIpc,
            payload: vec![7; 64],
            fd: None,
            base: s.0,
            size: s.1,
        })
    }
    fn export_caller(_: &FakeCtx, _: DevicePtr, base: DevicePtr, size: usize, _: &PointerInfo) -> Result<Export> {
        Ok(Export {
            kind: HandleKind::HipIpc,
            payload: vec![9; 64],
            fd: None,
            base,
            size,
        })
    }
    fn open_handle(_: &Arc<FakeCtx>, h: &ParsedHandle, _: Option<&OwnedFd>) -> Result<DevicePtr> {
        Ok(DevicePtr(h.base + 0x1000_0000))
    }
    fn mapping_ptr(m: &DevicePtr) -> DevicePtr {
        *m
    }
}

impl Rtc for Fake {
    fn max_parallel_compiles() -> usize {
        1
    }
    fn compile_target(_: &DeviceFacts, _: &()) -> Result<CompileTarget> {
        Ok(CompileTarget {
            arch: "fake1".into(),
            options: vec!["-fake".into()],
            compiler: "fakecc 1.0".into(),
            extension: "fake",
            image: ImageKind::Elf,
        })
    }
    fn compile(target: &CompileTarget, unit: &str, text: &str) -> Result<Vec<u8>> {
        log().compiles.push((unit.to_string(), std::thread::current().id()));
        std::thread::sleep(COMPILE_TIME);
        if text.contains("this_is_not_defined") {
            return Err(target.error(unit, "error: use of undeclared identifier 'this_is_not_defined'".into()));
        }
        let mut image = b"\x7fELF".to_vec();
        image.resize(64, 0);
        image.extend_from_slice(text.as_bytes());
        Ok(image)
    }
    fn rtc_info() -> String {
        "fakecc 1.0".into()
    }
}
