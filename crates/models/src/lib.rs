//! mference-models
