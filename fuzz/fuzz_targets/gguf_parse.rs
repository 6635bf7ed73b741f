//! Any byte string given to the GGUF parser must give `Ok` or `Err`, never a panic, an
//! out-of-bounds read or a runaway allocation; a file that parses must have readable tensors.
#![no_main]

use ferrite_gguf::{dequantize_tensor, GgufFile};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(file) = GgufFile::from_bytes(data.to_vec()) else { return };
    for t in &file.tensors {
        assert_eq!(file.tensor_data(t).len(), t.n_bytes);
        let values = dequantize_tensor(&file, t).expect("validated tensors dequantize");
        assert_eq!(values.len() as u64, t.n_elements());
    }
    for (key, _) in file.metadata.iter() {
        let _ = (file.metadata.u64(key), file.metadata.f32(key), file.metadata.str(key));
        let _ = (file.metadata.str_array(key), file.metadata.f32_array(key), file.metadata.i32_array(key));
    }
});
