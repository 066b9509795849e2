//! mference-text
