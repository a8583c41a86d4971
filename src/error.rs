//! The crate's error type.

use std::fmt;

pub use cuda_stream_pool_sys::{LoadError, MissingSymbol};

/// A driver result code (`CUresult`), kept as the raw number so that codes this crate does not
/// name still round-trip.
///
/// ```
/// use cuda_stream_pool::ErrorCode;
/// assert_eq!(ErrorCode::ERROR_ILLEGAL_STATE, ErrorCode(401));
/// assert_eq!(ErrorCode(401).known_name(), Some("CUDA_ERROR_ILLEGAL_STATE"));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ErrorCode(pub u32);

macro_rules! codes {
    ($($name:ident = $value:expr),* $(,)?) => {
        impl ErrorCode {
            $(
                #[doc = concat!("`CUDA_", stringify!($name), "` (", stringify!($value), ")")]
                pub const $name: ErrorCode = ErrorCode($value);
            )*
            /// The driver's name for this code, e.g. `CUDA_ERROR_ILLEGAL_STATE`, when the crate
            /// knows it.
            ///
            /// ```
            /// use cuda_stream_pool::ErrorCode;
            /// assert_eq!(ErrorCode::ERROR_NOT_READY.known_name(), Some("CUDA_ERROR_NOT_READY"));
            /// assert_eq!(ErrorCode(12345).known_name(), None);
            /// ```
            pub fn known_name(self) -> Option<&'static str> {
                match self.0 {
                    $($value => Some(concat!("CUDA_", stringify!($name))),)*
                    _ => None,
                }
            }
        }
    };
}

codes! {
    SUCCESS = 0,
    ERROR_INVALID_VALUE = 1,
    ERROR_OUT_OF_MEMORY = 2,
    ERROR_NOT_INITIALIZED = 3,
    ERROR_DEINITIALIZED = 4,
    ERROR_STUB_LIBRARY = 34,
    ERROR_DEVICE_UNAVAILABLE = 46,
    ERROR_NO_DEVICE = 100,
    ERROR_INVALID_DEVICE = 101,
    ERROR_INVALID_IMAGE = 200,
    ERROR_INVALID_CONTEXT = 201,
    ERROR_NO_BINARY_FOR_GPU = 209,
    ERROR_INVALID_PTX = 218,
    ERROR_UNSUPPORTED_PTX_VERSION = 222,
    ERROR_INVALID_SOURCE = 300,
    ERROR_FILE_NOT_FOUND = 301,
    ERROR_INVALID_HANDLE = 400,
    ERROR_ILLEGAL_STATE = 401,
    ERROR_NOT_FOUND = 500,
    ERROR_NOT_READY = 600,
    ERROR_ILLEGAL_ADDRESS = 700,
    ERROR_LAUNCH_OUT_OF_RESOURCES = 701,
    ERROR_LAUNCH_TIMEOUT = 702,
    ERROR_HARDWARE_STACK_ERROR = 714,
    ERROR_ILLEGAL_INSTRUCTION = 715,
    ERROR_MISALIGNED_ADDRESS = 716,
    ERROR_INVALID_ADDRESS_SPACE = 717,
    ERROR_INVALID_PC = 718,
    ERROR_LAUNCH_FAILED = 719,
    ERROR_NOT_PERMITTED = 800,
    ERROR_NOT_SUPPORTED = 801,
    ERROR_STREAM_CAPTURE_UNSUPPORTED = 900,
    ERROR_STREAM_CAPTURE_INVALIDATED = 901,
    ERROR_STREAM_CAPTURE_MERGE = 902,
    ERROR_STREAM_CAPTURE_UNMATCHED = 903,
    ERROR_STREAM_CAPTURE_UNJOINED = 904,
    ERROR_STREAM_CAPTURE_ISOLATION = 905,
    ERROR_STREAM_CAPTURE_IMPLICIT = 906,
    ERROR_CAPTURED_EVENT = 907,
    ERROR_STREAM_CAPTURE_WRONG_THREAD = 908,
    ERROR_UNKNOWN = 999,
}

impl ErrorCode {
    /// Whether the code is a *sticky* error: a kernel faulted its context (an illegal address,
    /// instruction or program counter, a misaligned or wrong-space access, a hardware stack
    /// error, a launch failure or timeout). The context is then dead: every later call that
    /// touches it returns the same code, work enqueued in it never completes, and (measured on
    /// an H200, driver 580) the process cannot create a working context on that device again.
    ///
    /// ```
    /// use cuda_stream_pool::ErrorCode;
    /// assert!(ErrorCode::ERROR_ILLEGAL_ADDRESS.is_sticky());
    /// assert!(!ErrorCode::ERROR_OUT_OF_MEMORY.is_sticky());
    /// ```
    pub fn is_sticky(self) -> bool {
        matches!(self.0, 700 | 702 | 714..=719)
    }
}

/// Everything that can go wrong in this crate. No public function panics on bad input or on a
/// driver failure: it returns one of these.
///
/// ```
/// use cuda_stream_pool::{driver, Context, Error, ErrorCode, Priority};
/// let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
/// let ctx = Context::primary(drv, 0).unwrap();
/// let owner = ctx.owner();
/// let s = owner.stream().unwrap();
/// let _capture = s.begin_capture().unwrap();
/// match s.begin_capture() {
///     Err(e @ Error::Driver { .. }) => {
///         assert_eq!(e.code(), Some(ErrorCode::ERROR_ILLEGAL_STATE));
///         assert_eq!(e.to_string(), "cuStreamBeginCapture_v2 failed: CUDA_ERROR_ILLEGAL_STATE (401)");
///     }
///     other => panic!("{other:?}"),
/// }
/// assert!(matches!(owner.set_priority(Priority::High), Err(Error::CaptureInProgress(_))));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Error {
    /// A driver entry point returned an error code.
    Driver {
        /// The result code.
        code: ErrorCode,
        /// Its name, e.g. `CUDA_ERROR_ILLEGAL_STATE`.
        name: &'static str,
        /// The entry point that returned it, e.g. `cuStreamBeginCapture_v2`.
        call: &'static str,
    },
    /// The driver library could not be opened; lists what was searched.
    LibraryNotFound(LoadError),
    /// The driver does not export an entry point the operation needs.
    MissingSymbol(MissingSymbol),
    /// An argument was rejected before reaching the driver (a priority outside the context's
    /// range, mismatched lengths, a handle of another context, ...).
    InvalidArgument(String),
    /// The operation is not allowed while the stream is being captured into a graph.
    CaptureInProgress(String),
    /// The pool of a (priority, flags) key is at its cap of live streams, or other owners wait
    /// for it, and the caller asked not to wait ([`crate::Owner::try_stream`]).
    AtCap {
        /// The key's priority.
        priority: i32,
        /// The key's cap ([`crate::ContextOptions::max_live_streams_per_key`]).
        cap: usize,
    },
}

impl Error {
    /// The driver's result code, for [`Error::Driver`].
    ///
    /// ```
    /// use cuda_stream_pool::{Error, ErrorCode};
    /// let e = Error::driver(ErrorCode::ERROR_OUT_OF_MEMORY, "cuMemAllocAsync");
    /// assert_eq!(e.code(), Some(ErrorCode::ERROR_OUT_OF_MEMORY));
    /// assert_eq!(Error::InvalidArgument("x".into()).code(), None);
    /// ```
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            Error::Driver { code, .. } => Some(*code),
            _ => None,
        }
    }

    /// Whether this is a sticky error of the driver ([`ErrorCode::is_sticky`]): the context is
    /// dead, and retrying is pointless (see [`crate::Context::health`]).
    pub fn is_sticky(&self) -> bool {
        self.code().is_some_and(ErrorCode::is_sticky)
    }

    /// Builds a driver error whose name comes from the crate's table (`CUDA_ERROR_(unnamed)` for
    /// a code the crate does not name), for example in a [`crate::driver::Driver`] of your own.
    ///
    /// ```
    /// use cuda_stream_pool::{Error, ErrorCode};
    /// let e = Error::driver(ErrorCode::ERROR_OUT_OF_MEMORY, "cuMemAllocAsync");
    /// assert_eq!(e.to_string(), "cuMemAllocAsync failed: CUDA_ERROR_OUT_OF_MEMORY (2)");
    /// assert_eq!(
    ///     Error::driver(ErrorCode(12345), "cuInit").to_string(),
    ///     "cuInit failed: CUDA_ERROR_(unnamed) (12345)"
    /// );
    /// ```
    pub fn driver(code: ErrorCode, call: &'static str) -> Error {
        Error::Driver {
            code,
            name: code.known_name().unwrap_or("CUDA_ERROR_(unnamed)"),
            call,
        }
    }

    pub(crate) fn invalid(msg: impl Into<String>) -> Error {
        Error::InvalidArgument(msg.into())
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Driver { code, name, call } => write!(f, "{call} failed: {name} ({})", code.0),
            Error::LibraryNotFound(e) => e.fmt(f),
            Error::MissingSymbol(e) => e.fmt(f),
            Error::InvalidArgument(m) => write!(f, "invalid argument: {m}"),
            Error::CaptureInProgress(m) => write!(f, "not allowed during stream capture: {m}"),
            Error::AtCap { priority, cap } => write!(
                f,
                "the pool of priority {priority} is at its cap of {cap} live streams (or owners \
                 wait for it): wait with Owner::ready().await or Owner::stream"
            ),
        }
    }
}

/// The wrapping variants are transparent: `Display` is the inner error's, and `source` is the
/// inner error's source (none), so an error chain never repeats a message.
impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::LibraryNotFound(e) => e.source(),
            Error::MissingSymbol(e) => e.source(),
            _ => None,
        }
    }
}

impl From<LoadError> for Error {
    fn from(e: LoadError) -> Self {
        Error::LibraryNotFound(e)
    }
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_chain_never_repeats_a_message() {
        use std::error::Error as _;
        let e = Error::from(LoadError {
            tried: vec![("libcuda.so.1".into(), "not found".into())],
        });
        let mut chain = vec![e.to_string()];
        let mut src = e.source();
        while let Some(s) = src {
            chain.push(s.to_string());
            src = s.source();
        }
        for (i, a) in chain.iter().enumerate() {
            for b in &chain[i + 1..] {
                assert!(!a.contains(b.as_str()), "{a:?} repeats {b:?}");
            }
        }
    }

    #[test]
    fn driver_errors_name_code_and_call() {
        let e = Error::driver(ErrorCode::ERROR_ILLEGAL_STATE, "cuStreamBeginCapture_v2");
        assert_eq!(
            e.to_string(),
            "cuStreamBeginCapture_v2 failed: CUDA_ERROR_ILLEGAL_STATE (401)"
        );
        assert_eq!(e.code(), Some(ErrorCode(401)));
        assert_eq!(ErrorCode(12345).known_name(), None);
    }
}
