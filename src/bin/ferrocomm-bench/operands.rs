//! `--operands plain|heap|both`: where the `--coll` rows' input and output
//! buffers live. `plain`: `comm.alloc`, per row (the inbox exchange and
//! reduce-to). `heap`: the communicator's symmetric heap
//! (`comm.heap_alloc`), allocated once for the sweep's largest row, so
//! all-gather (outputs in the heap) and reduce-scatter and reduce (inputs in
//! the heap) take the direct kinds from `FERROCOMM_DIRECT_MIN_BYTES` a peer
//! (docs/protocol.md "Direct exchange", "Direct reduce-to"). `both`: every
//! plain row first, before the heap is reserved (a communicator with a heap
//! would launch the direct kinds on plain buffers too, only to fall back),
//! then every heap row, and a table pairing them.

use ferrocomm::device::{BackendKind, Device, DeviceBuffer, DevicePtr};
use ferrocomm::heap::{HeapBuffer, HEAP_ALIGN, HEAP_RESERVED};
use ferrocomm::{CommOptions, Communicator, DType, Error, Result, Tensor};

use crate::args::{Args, Operands};
use crate::timing::rotation;

/// Bytes between rotated inputs in the heap (each starts on the heap's
/// alignment, as a `heap_alloc` of its own would).
fn stride(in_bytes: usize) -> usize {
    in_bytes.max(1).next_multiple_of(HEAP_ALIGN)
}

/// The heap rows' two allocations: (the largest row's rotated inputs, the
/// largest row's output), in bytes.
fn regions(a: &Args, world: usize) -> (usize, usize) {
    let (mut input, mut output) = (0usize, 0usize);
    for &coll in &a.colls {
        for &dtype in &a.dtypes {
            for bytes in a.sizes(dtype, world) {
                if let Some((n_in, n_out)) = coll.counts(bytes, dtype, world) {
                    let (in_bytes, out_bytes) = (n_in * dtype.size(), n_out * dtype.size());
                    input = input.max(rotation(in_bytes) * stride(in_bytes));
                    output = output.max(out_bytes.max(in_bytes));
                }
            }
        }
    }
    (input.max(1), output.max(1))
}

/// Heap bytes the heap rows need: the reserved sync area and both regions.
fn heap_needed(a: &Args, world: usize) -> usize {
    let (input, output) = regions(a, world);
    (HEAP_RESERVED + input.next_multiple_of(HEAP_ALIGN) + output.next_multiple_of(HEAP_ALIGN)).next_multiple_of(4096)
}

/// With heap rows: a heap that holds them, unless `FERROCOMM_HEAP_BYTES`
/// (or the options) set one, which must then be large enough.
pub fn with_heap(opts: CommOptions, a: &Args, backend: BackendKind, world: usize) -> Result<CommOptions> {
    if !a.operands.contains(&Operands::Heap) {
        return Ok(opts);
    }
    let need = heap_needed(a, world);
    match opts.heap_bytes {
        None => {
            let bytes = need.max(opts.heap_bytes_for(backend));
            Ok(opts.with_heap_bytes(bytes))
        }
        Some(have) if have >= need => Ok(opts),
        Some(have) => Err(Error::invalid(format!(
            "--operands heap needs a symmetric heap of {need} bytes per rank for --max-bytes {} (the largest row's \
             rotated inputs and its output), FERROCOMM_HEAP_BYTES is {have}: raise it on every rank (or leave it \
             unset: the bench then sizes the heap), or lower --max-bytes",
            a.max_bytes
        ))),
    }
}

/// The heap rows' buffers, allocated once (collectively) for the sweep.
pub struct HeapOperands {
    input: HeapBuffer,
    output: HeapBuffer,
}

impl HeapOperands {
    pub fn alloc<D: Device>(comm: &Communicator<D>, a: &Args) -> Result<HeapOperands> {
        let (input, output) = regions(a, comm.size());
        let context = |e: Error| {
            Error::invalid(format!(
                "--operands heap: allocating {input} + {output} bytes of the symmetric heap failed: {e}"
            ))
        };
        let input = comm.heap_alloc(input).map_err(context)?;
        let output = comm.heap_alloc(output).map_err(context)?;
        Ok(HeapOperands { input, output })
    }

    pub fn free<D: Device>(self, comm: &Communicator<D>) -> Result<()> {
        comm.heap_free(self.output)?;
        comm.heap_free(self.input)
    }
}

/// One row's buffers: `nbuf` rotated inputs of `in_bytes` and one output.
pub enum RowBuffers<'h, D: Device> {
    Plain { inputs: Vec<D::Buffer>, output: D::Buffer },
    Heap { heap: &'h HeapOperands, stride: usize },
}

impl<'h, D: Device> RowBuffers<'h, D> {
    /// Plain buffers for the row (`heap: None`), or views of the heap's.
    pub fn new(
        comm: &Communicator<D>,
        heap: Option<&'h HeapOperands>,
        nbuf: usize,
        in_bytes: usize,
        out_bytes: usize,
    ) -> Result<Self> {
        match heap {
            None => Ok(RowBuffers::Plain {
                inputs: (0..nbuf).map(|_| comm.alloc(in_bytes)).collect::<Result<_>>()?,
                output: comm.alloc(out_bytes.max(in_bytes))?,
            }),
            Some(heap) => {
                let stride = stride(in_bytes);
                if nbuf * stride > heap.input.len() || out_bytes.max(in_bytes) > heap.output.len() {
                    return Err(Error::invalid(
                        "--operands heap: a row outgrew the heap buffers sized for it",
                    ));
                }
                Ok(RowBuffers::Heap { heap, stride })
            }
        }
    }

    pub fn operands(&self) -> Operands {
        match self {
            RowBuffers::Plain { .. } => Operands::Plain,
            RowBuffers::Heap { .. } => Operands::Heap,
        }
    }

    /// Rotated input `i` as `count` elements of `dtype`.
    pub fn input(&self, i: usize, dtype: DType, count: usize) -> Result<Tensor> {
        match self {
            RowBuffers::Plain { inputs, .. } => Tensor::view(&inputs[i], dtype, 0, count),
            RowBuffers::Heap { heap, stride } => Tensor::view(&heap.input, dtype, i * stride, count),
        }
    }

    pub fn output(&self, dtype: DType, count: usize) -> Result<Tensor> {
        match self {
            RowBuffers::Plain { output, .. } => Tensor::view(output, dtype, 0, count),
            RowBuffers::Heap { heap, .. } => Tensor::view(&heap.output, dtype, 0, count),
        }
    }

    pub fn input_ptr(&self, i: usize) -> DevicePtr {
        match self {
            RowBuffers::Plain { inputs, .. } => inputs[i].ptr(),
            RowBuffers::Heap { heap, stride } => heap.input.ptr().offset(i * stride),
        }
    }

    pub fn output_ptr(&self) -> DevicePtr {
        match self {
            RowBuffers::Plain { output, .. } => output.ptr(),
            RowBuffers::Heap { heap, .. } => heap.output.ptr(),
        }
    }

    /// `data` into each of the `nbuf` inputs, then wait for the
    /// communicator's stream (the runs go on another).
    pub fn write_inputs(&self, comm: &Communicator<D>, nbuf: usize, data: &[u8]) -> Result<()> {
        for i in 0..nbuf {
            match self {
                RowBuffers::Plain { inputs, .. } => comm.write(&inputs[i], 0, data)?,
                RowBuffers::Heap { heap, stride } => comm.heap_write(&heap.input, i * stride, data)?,
            }
        }
        comm.device().synchronize(comm.stream())
    }

    /// `data` into the output, then wait for the communicator's stream.
    pub fn write_output(&self, comm: &Communicator<D>, data: &[u8]) -> Result<()> {
        match self {
            RowBuffers::Plain { output, .. } => comm.write(output, 0, data)?,
            RowBuffers::Heap { heap, .. } => comm.heap_write(&heap.output, 0, data)?,
        }
        comm.device().synchronize(comm.stream())
    }

    /// Poison the output's first `len` bytes (0x7F), ordered before what
    /// `stream` runs next.
    pub fn poison_output(&self, comm: &Communicator<D>, len: usize, stream: &D::Stream) -> Result<()> {
        match self {
            RowBuffers::Plain { output, .. } => comm.device().memset(output, 0, len, 0x7F, stream),
            RowBuffers::Heap { .. } => self.write_output(comm, &vec![0x7F; len]),
        }
    }

    /// The output's first `got.len()` bytes, after what `stream` ran.
    pub fn read_output(&self, comm: &Communicator<D>, got: &mut [u8], stream: &D::Stream) -> Result<()> {
        match self {
            RowBuffers::Plain { output, .. } => comm.device().copy_to_host(output, 0, got, stream),
            RowBuffers::Heap { heap, .. } => {
                comm.device().synchronize(stream)?;
                comm.heap_read(&heap.output, 0, got)
            }
        }
    }
}
