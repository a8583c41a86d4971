//! cuda-stream-pool (crate docs are filled in below).
#![warn(missing_docs)]

pub mod driver;
mod error;

pub use error::{Error, ErrorCode, LoadError, MissingSymbol, Result};
