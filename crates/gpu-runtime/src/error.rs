//! The typed error of every device call.
//!
//! Callers decide what to do by matching a [`GpuError`] variant (a bad
//! pointer, out of memory, a sticky stream error, a capture refusal, ...),
//! never by reading message text. Every variant still formats to a message
//! naming the operation and, where there is one, the pointer, stream, event,
//! graph or kernel involved.
//!
//! Invariants:
//! - errors that wrap an earlier error (a stream's sticky error, a failed
//!   kernel, an invalidated capture) print the wrapped message in their own
//!   and keep it as a field rather than as `source()`, so an error chain
//!   formatted with `{:#}` does not repeat it; [`GpuError::root`] walks to
//!   the innermost one;
//! - the type is `Clone + Send + Sync + 'static`, so a stream can keep the
//!   first error of its queued work and report it later.

use std::fmt;

use crate::gpu::{ArgKind, DevicePtr, KernelArg, StreamId};

/// `Result` with [`GpuError`] as the default error.
pub type Result<T, E = GpuError> = std::result::Result<T, E>;

/// An allocation as named in an error: its label, base and size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AllocationRef {
    /// The label given at allocation.
    pub label: String,
    /// Its device address.
    pub base: DevicePtr,
    /// Its size in bytes.
    pub bytes: usize,
}

impl fmt::Display for AllocationRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "'{}' ({}, {} bytes)", self.label, self.base, self.bytes)
    }
}

/// What went wrong in a device call.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum GpuError {
    /// A non-empty range at the null pointer.
    #[error("{op}: null pointer ({bytes} bytes at {})", DevicePtr::NULL)]
    NullPointer {
        /// The operation.
        op: String,
        /// Bytes asked for.
        bytes: usize,
    },
    /// A range that starts inside a live allocation and runs past its end.
    #[error("{op}: {bytes} bytes at {ptr} run {over} bytes past the end of allocation {alloc}")]
    OutOfBounds {
        /// The operation.
        op: String,
        /// Start of the range.
        ptr: DevicePtr,
        /// Bytes asked for.
        bytes: usize,
        /// Bytes past the end.
        over: u64,
        /// The allocation it starts in.
        alloc: AllocationRef,
    },
    /// A pointer into an allocation that has been freed.
    #[error("{op}: use after free: {ptr} is inside allocation {alloc}, which was freed")]
    UseAfterFree {
        /// The operation.
        op: String,
        /// The pointer.
        ptr: DevicePtr,
        /// The freed allocation.
        alloc: AllocationRef,
    },
    /// A pointer inside no live (or remembered freed) allocation.
    #[error("{op}: {ptr} ({bytes} bytes) is not inside any live allocation")]
    InvalidPointer {
        /// The operation.
        op: String,
        /// The pointer.
        ptr: DevicePtr,
        /// Bytes asked for.
        bytes: usize,
    },
    /// A pointer not aligned for the element type a kernel asked for.
    #[error("pointer {ptr} is not aligned for {ty}")]
    Misaligned {
        /// The pointer.
        ptr: DevicePtr,
        /// The element type.
        ty: &'static str,
    },
    /// `free` of a pointer inside an allocation, not at its start.
    #[error("free: {ptr} is {offset} bytes inside allocation {alloc}, not its start")]
    InteriorFree {
        /// The pointer.
        ptr: DevicePtr,
        /// Its offset from the allocation's start.
        offset: u64,
        /// The allocation.
        alloc: AllocationRef,
    },
    /// `free` of an allocation already freed.
    #[error(
        "free: double free of {ptr} (allocation '{}', {} bytes, already freed)",
        .alloc.label,
        .alloc.bytes
    )]
    DoubleFree {
        /// The pointer.
        ptr: DevicePtr,
        /// The allocation.
        alloc: AllocationRef,
    },
    /// `free` of a pointer that is not an allocation.
    #[error("free: {ptr} is not a live allocation")]
    NotAllocated {
        /// The pointer.
        ptr: DevicePtr,
    },
    /// Memory (or address space) for an allocation could not be had.
    #[error("{op} '{label}': {reason} ({bytes} bytes)")]
    OutOfMemory {
        /// The operation.
        op: String,
        /// The allocation's label.
        label: String,
        /// Bytes asked for.
        bytes: usize,
        /// What ran out.
        reason: String,
    },
    /// A thread, handle or similar resource could not be created.
    #[error("{op}: {reason}")]
    OutOfResources {
        /// The operation.
        op: String,
        /// What could not be created, and why.
        reason: String,
    },
    /// A stream id the backend does not know (never created, or destroyed).
    #[error("{op}: unknown stream {stream}")]
    UnknownStream {
        /// The operation.
        op: String,
        /// The stream.
        stream: StreamId,
    },
    /// Work submitted to a stream that is being destroyed.
    #[error("stream {stream} has been destroyed")]
    StreamDestroyed {
        /// The stream.
        stream: StreamId,
    },
    /// An event handle the backend does not know.
    #[error("{op}: unknown event {event}")]
    UnknownEvent {
        /// The operation.
        op: String,
        /// The event's handle value.
        event: u64,
    },
    /// A graph handle the backend does not know.
    #[error("{op}: unknown graph {graph}")]
    UnknownGraph {
        /// The operation.
        op: String,
        /// The graph's handle value.
        graph: u64,
    },
    /// The sticky error of a stream: queued work failed earlier, and this
    /// synchronising call reports it (once).
    #[error("{op}: earlier work on stream {stream} failed: {cause}")]
    Stream {
        /// The synchronising operation that reports it.
        op: String,
        /// The stream.
        stream: StreamId,
        /// The error of the queued work.
        cause: Box<GpuError>,
    },
    /// A blocking call made from inside queued work, where waiting would
    /// deadlock.
    #[error("{op}: called from inside a queued operation, where waiting on {on} would deadlock")]
    WouldDeadlock {
        /// The operation.
        op: String,
        /// What it would have waited on (`stream 3`, `event 7`).
        on: String,
    },
    /// An operation refused because its stream is capturing; the capture is
    /// invalidated.
    #[error("{op}: stream {stream} is capturing; {why}")]
    CaptureViolation {
        /// The operation.
        op: String,
        /// The capturing stream.
        stream: StreamId,
        /// Why it cannot be captured.
        why: String,
    },
    /// `begin_capture` on a stream that is already capturing, or
    /// `destroy_stream` of a capturing stream.
    #[error("{op}: stream {stream} is already capturing")]
    AlreadyCapturing {
        /// The operation.
        op: String,
        /// The stream.
        stream: StreamId,
    },
    /// `end_capture` on a stream that is not capturing.
    #[error("end_capture: stream {stream} is not capturing")]
    NotCapturing {
        /// The stream.
        stream: StreamId,
    },
    /// `end_capture` of a capture that an earlier refusal invalidated.
    #[error("end_capture: the capture on stream {stream} was invalidated by: {cause}")]
    CaptureInvalidated {
        /// The stream.
        stream: StreamId,
        /// The refusal that invalidated it.
        cause: Box<GpuError>,
    },
    /// No kernel of that name.
    #[error("kernel {module}::{name}: no such kernel ({})", known_list(.module, .known))]
    NoSuchKernel {
        /// The module asked for.
        module: String,
        /// The kernel asked for.
        name: String,
        /// The kernels the module has, sorted.
        known: Vec<String>,
    },
    /// A kernel handle the backend does not know.
    #[error("launch_kernel: unknown kernel handle {handle}")]
    UnknownKernelHandle {
        /// The handle value.
        handle: u64,
    },
    /// A launch with the wrong number of arguments.
    #[error("launch_kernel {kernel}: expected {expected} arguments, got {got}")]
    ArgCount {
        /// `module::name`.
        kernel: String,
        /// Arguments in the signature.
        expected: usize,
        /// Arguments given.
        got: usize,
    },
    /// A launch argument of the wrong kind.
    #[error("launch_kernel {kernel}: argument {index}: expected {expected:?}, got {:?} ({got:?})", .got.kind())]
    ArgType {
        /// `module::name`.
        kernel: String,
        /// The argument's position.
        index: usize,
        /// The kind the signature wants.
        expected: ArgKind,
        /// The argument given.
        got: KernelArg,
    },
    /// A launch geometry with a zero dimension.
    #[error(
        "launch_kernel {kernel}: grid {grid:?} and block {block:?} must have no zero dimension"
    )]
    InvalidLaunch {
        /// `module::name`.
        kernel: String,
        /// Blocks.
        grid: (u32, u32, u32),
        /// Threads per block.
        block: (u32, u32, u32),
    },
    /// An error raised by a kernel body itself (see [`GpuError::kernel`]).
    #[error("{message}")]
    Kernel {
        /// What the body reported.
        message: String,
    },
    /// A kernel that failed while running on a stream.
    #[error("{op} {kernel} failed: {cause}")]
    KernelFailed {
        /// The operation and stream (`launch_kernel on stream 3`).
        op: String,
        /// `module::name`.
        kernel: String,
        /// What the body returned.
        cause: Box<GpuError>,
    },
    /// A kernel body that panicked.
    #[error("{op} {kernel} panicked: {message}")]
    KernelPanicked {
        /// The operation and stream (`launch_kernel on stream 3`).
        op: String,
        /// `module::name`.
        kernel: String,
        /// The panic message.
        message: String,
    },
    /// An argument the operation cannot accept (destroying the default
    /// stream, an empty kernel name, a null host pointer, ...).
    #[error("{op}: {message}")]
    InvalidArgument {
        /// The operation.
        op: String,
        /// What is wrong with it.
        message: String,
    },
    /// Something this backend (or this build of it) cannot do.
    #[error("{op}: {reason}")]
    Unsupported {
        /// The operation.
        op: String,
        /// Why.
        reason: String,
    },
    /// A call into the device driver (or its run-time compiler) failed.
    #[error("{op}: {call} failed: {error}")]
    Driver {
        /// The operation.
        op: String,
        /// The driver function called (`cuMemAlloc`, `nvrtcCompileProgram`).
        call: String,
        /// The driver's error: its name and description.
        error: String,
    },
}

fn known_list(module: &str, known: &[String]) -> String {
    if known.is_empty() {
        format!("no kernels registered in module '{module}'")
    } else {
        format!("module '{module}' has: {}", known.join(", "))
    }
}

impl GpuError {
    /// An error raised by a kernel body: `message` says what is wrong. The
    /// backend adds the kernel's name and stream when it reports it.
    pub fn kernel(message: impl fmt::Display) -> GpuError {
        GpuError::Kernel {
            message: message.to_string(),
        }
    }

    /// An [`GpuError::InvalidArgument`] of `op`.
    pub fn invalid(op: impl Into<String>, message: impl Into<String>) -> GpuError {
        GpuError::InvalidArgument {
            op: op.into(),
            message: message.into(),
        }
    }

    /// An [`GpuError::Unsupported`] of `op`.
    pub fn unsupported(op: impl Into<String>, reason: impl Into<String>) -> GpuError {
        GpuError::Unsupported {
            op: op.into(),
            reason: reason.into(),
        }
    }

    /// The innermost error: follows sticky stream errors, failed kernels and
    /// invalidated captures to what actually went wrong.
    pub fn root(&self) -> &GpuError {
        match self {
            GpuError::Stream { cause, .. }
            | GpuError::KernelFailed { cause, .. }
            | GpuError::CaptureInvalidated { cause, .. } => cause.root(),
            e => e,
        }
    }

    /// The device pointer at fault, for errors about a pointer.
    pub fn pointer(&self) -> Option<DevicePtr> {
        match self.root() {
            GpuError::NullPointer { .. } => Some(DevicePtr::NULL),
            GpuError::OutOfBounds { ptr, .. }
            | GpuError::UseAfterFree { ptr, .. }
            | GpuError::InvalidPointer { ptr, .. }
            | GpuError::Misaligned { ptr, .. }
            | GpuError::InteriorFree { ptr, .. }
            | GpuError::DoubleFree { ptr, .. }
            | GpuError::NotAllocated { ptr } => Some(*ptr),
            _ => None,
        }
    }

    /// Whether this is a sticky error of queued work, reported by a later
    /// synchronising call.
    pub fn is_sticky(&self) -> bool {
        matches!(self, GpuError::Stream { .. })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_name_what_went_wrong() {
        let alloc = AllocationRef {
            label: "buf".into(),
            base: DevicePtr(0x1000),
            bytes: 64,
        };
        let e = GpuError::OutOfBounds {
            op: "copy_h2d".into(),
            ptr: DevicePtr(0x1020),
            bytes: 40,
            over: 8,
            alloc,
        };
        assert_eq!(
            e.to_string(),
            "copy_h2d: 40 bytes at 0x1020 run 8 bytes past the end of allocation 'buf' (0x1000, 64 bytes)"
        );
        let s = GpuError::Stream {
            op: "synchronize".into(),
            stream: 3,
            cause: Box::new(GpuError::KernelFailed {
                op: "launch_kernel on stream 3".into(),
                kernel: "m::k".into(),
                cause: Box::new(GpuError::kernel("bad input")),
            }),
        };
        assert_eq!(
            s.to_string(),
            "synchronize: earlier work on stream 3 failed: launch_kernel on stream 3 m::k failed: bad input"
        );
        assert!(s.is_sticky());
        assert!(matches!(s.root(), GpuError::Kernel { message } if message == "bad input"));
        let k = GpuError::NoSuchKernel {
            module: "m".into(),
            name: "x".into(),
            known: vec!["a".into(), "b".into()],
        };
        assert_eq!(
            k.to_string(),
            "kernel m::x: no such kernel (module 'm' has: a, b)"
        );
    }

    #[test]
    fn errors_convert_to_anyhow_and_box() {
        fn takes<E: std::error::Error + Send + Sync + 'static>(_: E) {}
        takes(GpuError::kernel("x"));
        let b: Box<dyn std::error::Error + Send + Sync> = GpuError::NotAllocated {
            ptr: DevicePtr(0x42),
        }
        .into();
        assert_eq!(b.to_string(), "free: 0x42 is not a live allocation");
    }
}
