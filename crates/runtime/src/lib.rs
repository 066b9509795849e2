//! mference-runtime
