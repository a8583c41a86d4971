//! Raw CUDA driver API bindings for `cuda-stream-pool`.
//!
//! The declarations come from the crate's hand-written `wrapper.h`, turned into Rust by bindgen
//! (see the top-level `build.rs`); the generated file is committed so that building needs neither
//! libclang nor CUDA. The driver library itself is opened at run time by [`Library::open`]:
//!
//! * a missing library is a [`LoadError`] that lists every path that was tried;
//! * a symbol missing from an older driver is **not** an error at load time: each entry point is
//!   resolved when the library opens and kept as a `Result` in the table ([`Library::table`]);
//!   the caller turns a missing one into a [`MissingSymbol`] (with [`introduced_in`]) naming the
//!   symbol and the CUDA version that introduced it, when it first needs it. Nothing here panics.
//!
//! This crate is the only place, besides the real driver in `cuda-stream-pool`, where `unsafe`
//! code calls into the driver.

#![allow(clippy::missing_safety_doc)]

/// The generated declarations: types, enum constants and the [`ffi::CudaLib`] table of entry
/// points.
#[allow(
    non_camel_case_types,
    non_snake_case,
    non_upper_case_globals,
    dead_code,
    clippy::all,
    clippy::missing_errors_doc,
    clippy::missing_panics_doc,
    rustdoc::all,
    missing_docs
)]
pub mod ffi {
    include!("bindings.rs");
}

use std::ffi::OsString;
use std::fmt;

/// Environment variable naming the driver library to open instead of the default search.
pub const LIBRARY_ENV: &str = "CUDA_STREAM_POOL_LIBCUDA";

/// Names tried, in order, when [`LIBRARY_ENV`] is not set.
pub const DEFAULT_NAMES: [&str; 2] = ["libcuda.so.1", "libcuda.so"];

/// The driver library could not be opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadError {
    /// Every path or name that was tried, with the loader's message for each.
    pub tried: Vec<(String, String)>,
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "cannot open the CUDA driver library (tried ")?;
        for (i, (name, why)) in self.tried.iter().enumerate() {
            if i > 0 {
                write!(f, "; ")?;
            }
            write!(f, "{name}: {why}")?;
        }
        write!(f, "); set {LIBRARY_ENV} to its path")
    }
}

impl std::error::Error for LoadError {}

/// An opened driver library.
pub struct Library {
    table: ffi::CudaLib,
    path: String,
}

impl fmt::Debug for Library {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Library").field("path", &self.path).finish()
    }
}

impl Library {
    /// Opens the driver: the path in [`LIBRARY_ENV`] when set, else `libcuda.so.1`, then
    /// `libcuda.so`.
    ///
    /// # Errors
    /// A [`LoadError`] listing every candidate and the loader's message for it, when none opens.
    pub fn open() -> Result<Library, LoadError> {
        let candidates: Vec<OsString> = match std::env::var_os(LIBRARY_ENV) {
            Some(p) if !p.is_empty() => vec![p],
            _ => DEFAULT_NAMES.iter().map(OsString::from).collect(),
        };
        let mut tried = Vec::new();
        for name in candidates {
            // SAFETY: opening libcuda runs its initialisers, which have no preconditions on the
            // caller; the symbols are resolved into `Result`s and nothing is called yet.
            match unsafe { ffi::CudaLib::new(&name) } {
                Ok(table) => {
                    return Ok(Library {
                        table,
                        path: name.to_string_lossy().into_owned(),
                    })
                }
                Err(e) => tried.push((name.to_string_lossy().into_owned(), e.to_string())),
            }
        }
        Err(LoadError { tried })
    }

    /// The path or name the library was opened from.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The table of entry points; each is `Ok` when the library exports it.
    pub fn table(&self) -> &ffi::CudaLib {
        &self.table
    }
}

/// A driver entry point that the opened library does not export.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MissingSymbol {
    /// The exported name, e.g. `cuMemAllocAsync`.
    pub symbol: &'static str,
    /// The CUDA version that introduced it, e.g. `11.2`.
    pub since: &'static str,
}

impl fmt::Display for MissingSymbol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the CUDA driver does not export {} (introduced in CUDA {}); update the driver",
            self.symbol, self.since
        )
    }
}

impl std::error::Error for MissingSymbol {}

/// The CUDA version that introduced an entry point of `wrapper.h`.
pub fn introduced_in(symbol: &str) -> &'static str {
    match symbol {
        "cuStreamGetCaptureInfo_v3" => "12.3",
        "cuStreamGetCaptureInfo_v2" => "11.3",
        "cuStreamWriteValue64_v2" | "cuStreamWaitValue32_v2" => "11.7",
        "cuGraphInstantiateWithFlags" => "11.4",
        "cuMemAllocAsync"
        | "cuMemFreeAsync"
        | "cuMemAllocFromPoolAsync"
        | "cuDeviceGetDefaultMemPool"
        | "cuMemPoolSetAttribute"
        | "cuMemPoolCreate"
        | "cuMemPoolDestroy"
        | "cuMemPoolGetAttribute" => "11.2",
        "cuGraphUpload" => "11.1",
        "cuDevicePrimaryCtxRelease_v2" => "11.0",
        "cuStreamBeginCapture_v2" | "cuThreadExchangeStreamCaptureMode" => "10.1",
        "cuStreamEndCapture"
        | "cuStreamIsCapturing"
        | "cuGraphLaunch"
        | "cuGraphExecDestroy"
        | "cuGraphDestroy"
        | "cuGraphGetNodes"
        | "cuLaunchHostFunc" => "10.0",
        "cuCtxGetStreamPriorityRange" | "cuStreamCreateWithPriority" | "cuStreamGetPriority" => {
            "5.5"
        }
        "cuGetErrorName" | "cuGetErrorString" | "cuStreamGetFlags" => "6.0",
        "cuDevicePrimaryCtxRetain" | "cuDevicePrimaryCtxGetState" => "7.0",
        "cuStreamDestroy_v2" | "cuEventDestroy_v2" | "cuCtxGetCurrent" | "cuCtxSetCurrent" => "4.0",
        "cuMemGetInfo_v2"
        | "cuMemcpyHtoDAsync_v2"
        | "cuMemcpyDtoHAsync_v2"
        | "cuMemHostGetDevicePointer_v2" => "3.2",
        "cuMemHostAlloc" => "2.2",
        "cuLaunchKernel" | "cuMemsetD32Async" => "4.0",
        _ => "2.0",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_library_lists_what_was_tried() {
        std::env::set_var(LIBRARY_ENV, "/nonexistent/libcuda-for-test.so");
        let err = Library::open().unwrap_err();
        std::env::remove_var(LIBRARY_ENV);
        assert_eq!(err.tried.len(), 1);
        let msg = err.to_string();
        assert!(msg.contains("/nonexistent/libcuda-for-test.so"), "{msg}");
        assert!(msg.contains(LIBRARY_ENV), "{msg}");
    }

    #[test]
    fn versions_of_new_entry_points() {
        assert_eq!(introduced_in("cuMemAllocAsync"), "11.2");
        assert_eq!(introduced_in("cuStreamGetCaptureInfo_v3"), "12.3");
        assert_eq!(introduced_in("cuStreamWriteValue64_v2"), "11.7");
        assert_eq!(introduced_in("cuMemHostAlloc"), "2.2");
        let m = MissingSymbol {
            symbol: "cuMemAllocAsync",
            since: introduced_in("cuMemAllocAsync"),
        };
        assert!(m
            .to_string()
            .contains("cuMemAllocAsync (introduced in CUDA 11.2)"));
    }
}
