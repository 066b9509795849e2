//! Pinned presets: repo, revision and the SHA-256 of
//! `model.safetensors.index.json`, checked before planning.

/// One pinned source.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Preset {
    /// `--model` name.
    pub name: &'static str,
    pub repo: &'static str,
    pub revision: &'static str,
    pub index_sha256: &'static str,
}

/// The five pinned presets.
pub const PRESETS: &[Preset] = &[
    Preset {
        name: "gemma4",
        repo: "mlx-community/gemma-4-26b-a4b-it-4bit",
        revision: "0d77464eeb233a2da68ebf9d7dc4edaac7db956d",
        index_sha256: "bf198c9f5ea6462addca1966e5dd669c407537a876e82cf06db9084c5c850b13",
    },
    Preset {
        name: "qwen36",
        repo: "mlx-community/Qwen3.6-35B-A3B-4bit",
        revision: "38740b847e4cb78f352aba30aa41c76e08e6eb46",
        index_sha256: "0b28df60e33753a14e816d3b31577ae2c93884c58430a4a6de6ae9ea483842ea",
    },
    Preset {
        name: "deepseekv4flash",
        repo: "mlx-community/DeepSeek-V4-Flash-2bit-DQ",
        revision: "722bf559b7de93575b2320973cf2002e05bfe6c9",
        index_sha256: "d1c2d929ab0a35be32cf18026bb31d6f99dad58d6c93a5a2abbe43791f9d6c30",
    },
    Preset {
        name: "inklingsmall",
        repo: "pipenetwork/Inkling-Small-MLX-4bit",
        revision: "9d6e4720ab7002af25d6129c88ccea6cd9f19372",
        index_sha256: "fe16aec3cef12438f1d0ff657f7e785781b61271528a66b3b7160fcf1aaca30c",
    },
    Preset {
        name: "maple",
        repo: "deepgrove/maple-preview-2bit-mlx",
        revision: "361db5da5e74ff6fcdd852d478e1f266ce11013a",
        index_sha256: "56000110535c5023b43209a5c142035e12c1cde7b1118759cc9f86335d46ef95",
    },
];

/// Look a preset up by its `--model` name.
pub fn preset(name: &str) -> Option<&'static Preset> {
    PRESETS.iter().find(|p| p.name == name)
}
