//! mference-install
