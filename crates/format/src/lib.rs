//! mference-format
