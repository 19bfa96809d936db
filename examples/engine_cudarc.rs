//! An engine's view of ferrocomm: tensors and a stream the engine allocated
//! with cudarc, an all-reduce, an all-gather and a reduce-scatter captured on
//! that stream into one CUDA graph, and 1000 replays with new input each
//! time, every output checked. Run one process per GPU, for example:
//!
//! ```sh
//! cargo build --release --features cuda,nccl --example engine_cudarc
//! torchrun --nproc_per_node=2 --no-python target/release/examples/engine_cudarc
//! ```
//!
//! (or with `MASTER_ADDR`, `MASTER_PORT`, `RANK`, `WORLD_SIZE`, `LOCAL_RANK`
//! and `FERROCOMM_TOKEN` set by any launcher). `REPLAYS` changes the count.

#[cfg(feature = "cuda")]
fn main() -> std::process::ExitCode {
    match run() {
        Ok(msg) => {
            println!("RESULT ok {msg}");
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            println!("RESULT fail {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

#[cfg(not(feature = "cuda"))]
fn main() {
    eprintln!("this example needs --features cuda");
}

#[cfg(feature = "cuda")]
fn run() -> Result<String, Box<dyn std::error::Error>> {
    use cudarc::driver::{CudaContext, DevicePtr};
    use ferrocomm::backends::cuda::CudaDevice;
    use ferrocomm::bootstrap::rendezvous_from_env;
    use ferrocomm::device::Device;
    use ferrocomm::{Call, CommOptions, Communicator, DType, ReduceOp, Tensor};

    let rdv = rendezvous_from_env()?;
    let (rank, world) = (rdv.rank, rdv.world);
    // ferrocomm's device first: it reports a missing driver or GPU as an
    // error (cudarc would panic).
    let dev = CudaDevice::new(rdv.local_rank)?;
    let comm = Communicator::new(dev, rdv.store.clone(), rank, world, CommOptions::from_env()?)?;

    // The engine's own context, stream and memory.
    let ctx = CudaContext::new(rdv.local_rank)?;
    let stream = ctx.new_stream()?;
    let n = 64 * 1024 + 7; // odd, not a multiple of 16 bytes
    let ar = stream.alloc_zeros::<f32>(n)?;
    let ag_in = stream.alloc_zeros::<f32>(n)?;
    let ag_out = stream.alloc_zeros::<f32>(n * world)?;
    let rs_in = stream.alloc_zeros::<f32>(n * world)?;
    let rs_out = stream.alloc_zeros::<f32>(n)?;
    // Raw addresses of the engine's slices (the guards only order cudarc's
    // own multi-stream bookkeeping; everything here runs on one stream).
    let tensor = |s: &cudarc::driver::CudaSlice<f32>, count: usize| {
        let (ptr, _sync) = s.device_ptr(&stream);
        // SAFETY: the slices live until the end of `run`, after the stream
        // has run every replay.
        unsafe { Tensor::from_raw(ptr, count, DType::F32) }
    };
    let (t_ar, t_agi, t_ago, t_rsi, t_rso) = (
        tensor(&ar, n),
        tensor(&ag_in, n),
        tensor(&ag_out, n * world),
        tensor(&rs_in, n * world),
        tensor(&rs_out, n),
    );
    // SAFETY: the engine's stream outlives the borrowed wrapper and its work.
    let s = unsafe { comm.device().borrow_stream(stream.cu_stream() as u64)? };

    // One eager round (and `prepare`) before capturing, so no kernel is
    // compiled while the graph is recorded.
    let call = Call::on(&s);
    comm.all_reduce(t_ar, ReduceOp::Sum, &call)?;
    comm.all_gather_single(t_ago, t_agi, &call)?;
    comm.reduce_scatter_single(t_rso, t_rsi, ReduceOp::Sum, &call)?;
    comm.prepare()?;
    stream.synchronize()?;
    eprintln!("rank {rank}: eager round done");

    comm.device().begin_capture(&s)?;
    let captured = comm
        .all_reduce(t_ar, ReduceOp::Sum, &call)
        .and_then(|_| comm.all_gather_single(t_ago, t_agi, &call))
        .and_then(|_| comm.reduce_scatter_single(t_rso, t_rsi, ReduceOp::Sum, &call));
    let graph = comm.device().end_capture(&s)?;
    captured?;
    eprintln!("rank {rank}: captured");

    let replays: usize = std::env::var("REPLAYS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    // Small integers: every sum is exact, so the checks are bitwise.
    let value = |r: usize, i: usize, k: usize| ((r * 7 + i * 3 + k * 5) % 13) as f32 - 6.0;
    let mut ar_host = vec![0f32; n];
    let mut rs_host = vec![0f32; n * world];
    let mut ag_host = vec![0f32; n];
    let mut ar_buf = ar;
    let mut ag_buf = ag_in;
    let mut rs_buf = rs_in;
    let start = std::time::Instant::now();
    for k in 0..replays {
        for i in 0..n {
            ar_host[i] = value(rank, i, k);
            ag_host[i] = value(rank, i, k + 1);
        }
        for (i, x) in rs_host.iter_mut().enumerate() {
            *x = value(rank, i, k + 2);
        }
        stream.memcpy_htod(&ar_host, &mut ar_buf)?;
        stream.memcpy_htod(&ag_host, &mut ag_buf)?;
        stream.memcpy_htod(&rs_host, &mut rs_buf)?;
        comm.device().launch_graph(&graph, &s)?;
        let got_ar = stream.clone_dtoh(&ar_buf)?;
        let got_ag = stream.clone_dtoh(&ag_out)?;
        let got_rs = stream.clone_dtoh(&rs_out)?;
        for i in (0..n).step_by(if k % 100 == 0 { 1 } else { 97 }) {
            let want: f32 = (0..world).map(|r| value(r, i, k)).sum();
            if got_ar[i] != want {
                return Err(format!("replay {k}: all_reduce[{i}] = {} want {want}", got_ar[i]).into());
            }
            let want: f32 = (0..world).map(|r| value(r, rank * n + i, k + 2)).sum();
            if got_rs[i] != want {
                return Err(format!("replay {k}: reduce_scatter[{i}] = {} want {want}", got_rs[i]).into());
            }
        }
        for j in (0..n * world).step_by(if k % 100 == 0 { 1 } else { 89 }) {
            let want = value(j / n, j % n, k + 1);
            if got_ag[j] != want {
                return Err(format!("replay {k}: all_gather[{j}] = {} want {want}", got_ag[j]).into());
            }
        }
    }
    let secs = start.elapsed().as_secs_f64();
    eprintln!("rank {rank}: {replays} replays checked in {secs:.1} s");
    // Tear down in the order an engine would: the graph, the communicator's
    // work, the engine's memory and stream, then the communicator.
    drop(graph);
    comm.finalize()?;
    drop(s);
    drop((ar_buf, ag_buf, rs_buf, ag_out, rs_out));
    drop(stream);
    drop(ctx);
    drop(comm);
    eprintln!("rank {rank}: communicator dropped");
    drop(rdv);
    Ok(format!(
        "rank={rank} world={world} replays={replays} (all_reduce + all_gather + reduce_scatter of {n} f32, new input \
         each time, every 100th replay checked whole, the others sampled) in {secs:.1} s"
    ))
}
