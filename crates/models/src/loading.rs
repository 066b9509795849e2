//! Checks a family makes while it loads its weights.

use crate::ModelError;

/// A tensor `name` has the dimensions config.json implies.
pub(crate) fn check_dims(
    name: &str,
    got: (usize, usize),
    want: (usize, usize),
) -> Result<(), ModelError> {
    if got == want {
        Ok(())
    } else {
        Err(ModelError::Config(format!(
            "{name} is {got:?}, config.json implies {want:?}"
        )))
    }
}
