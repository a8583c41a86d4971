//! Loading the driver library: a missing library and a library without the entry points are
//! errors that say what is missing, never panics. (One test, because it sets the environment.)

use cuda_stream_pool::driver::{self, Choice, CudaDriver, Driver, Stream};
use cuda_stream_pool::Error;
use cuda_stream_pool_sys::LIBRARY_ENV;

#[test]
fn missing_library_and_missing_symbols_are_errors() {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        // No such file: the error lists what was tried.
        std::env::set_var(LIBRARY_ENV, "/nonexistent/libcuda.so.1");
        match CudaDriver::open() {
            Err(Error::LibraryNotFound(e)) => {
                assert!(e.to_string().contains("/nonexistent/libcuda.so.1"), "{e}")
            }
            other => panic!("{other:?}"),
        }
        // Forcing the real driver fails cleanly; auto falls back to the simulation and says why.
        assert!(driver::load(Choice::Cuda).is_err());
        let (d, why) = driver::load(Choice::Auto).unwrap();
        assert_eq!(d.kind(), "sim");
        assert!(matches!(why, Some(Error::LibraryNotFound(_))));

        // A library that exists but exports none of the entry points (the C math library): it
        // opens, and each entry point is an error naming the symbol and its CUDA version when used.
        std::env::set_var(LIBRARY_ENV, "libm.so.6");
        let d = CudaDriver::open().expect("libm opens");
        match d.init() {
            Err(Error::MissingSymbol(m)) => {
                assert_eq!(m.symbol, "cuInit");
                assert!(m.to_string().contains("cuInit"), "{m}");
            }
            other => panic!("{other:?}"),
        }
        match d.mem_alloc_async(16, Stream::NULL) {
            Err(Error::MissingSymbol(m)) => {
                assert_eq!((m.symbol, m.since), ("cuMemAllocAsync", "11.2"));
                assert!(m.to_string().contains("introduced in CUDA 11.2"), "{m}");
            }
            other => panic!("{other:?}"),
        }
        // Neither capture query exists: the older one (the fallback) is named.
        assert!(matches!(
            d.stream_capture_info(Stream::NULL),
            Err(Error::MissingSymbol(m))
                if (m.symbol, m.since) == ("cuStreamGetCaptureInfo_v2", "11.3")
        ));
        std::env::remove_var(LIBRARY_ENV);
    }
}
