#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| mference_fuzzing::run("layout", data));
