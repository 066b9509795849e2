//! mference-server
