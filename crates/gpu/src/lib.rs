//! GPU backends.
