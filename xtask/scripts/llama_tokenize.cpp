// Tokenizes texts with llama.cpp's own tokenizer (libllama's C API), for deco's independent
// test vectors (`cargo xtask fetch` without the mirror; see xtask/scripts/llama_reference.py).
//
// Usage: llama_tokenize MODEL.gguf CASES OUT
//   CASES: for each text, its length in bytes as a decimal line, then exactly that many bytes,
//          then one newline.
//   OUT:   for each text two lines of space-separated token ids: first with special-token text
//          treated as plain text (parse_special = false), then with it parsed (true).
//          No BOS/EOS is added (add_special = false), as llama-tokenize --no-bos and
//          test-tokenizer-0 do.
// Only the vocabulary is loaded (vocab_only), so no weights are read.
#include "llama.h"

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

static void quiet(enum ggml_log_level level, const char * text, void *) {
    if (level >= GGML_LOG_LEVEL_ERROR) {
        std::fputs(text, stderr);
    }
}

static std::vector<llama_token> tokenize(const llama_vocab * vocab, const std::string & text, bool parse_special) {
    std::vector<llama_token> out(text.size() + 16);
    int32_t n = llama_tokenize(vocab, text.data(), (int32_t) text.size(), out.data(), (int32_t) out.size(), false, parse_special);
    if (n < 0) {
        out.resize((size_t) -n);
        n = llama_tokenize(vocab, text.data(), (int32_t) text.size(), out.data(), (int32_t) out.size(), false, parse_special);
    }
    if (n < 0) {
        std::fprintf(stderr, "error: llama_tokenize failed (%d)\n", n);
        std::exit(1);
    }
    out.resize((size_t) n);
    return out;
}

int main(int argc, char ** argv) {
    if (argc != 4) {
        std::fprintf(stderr, "usage: %s MODEL.gguf CASES OUT\n", argv[0]);
        return 2;
    }
    llama_log_set(quiet, nullptr);
    llama_backend_init();
    llama_model_params params = llama_model_default_params();
    params.vocab_only = true;
    llama_model * model = llama_model_load_from_file(argv[1], params);
    if (model == nullptr) {
        std::fprintf(stderr, "error: cannot load the vocabulary of %s\n", argv[1]);
        return 1;
    }
    const llama_vocab * vocab = llama_model_get_vocab(model);

    std::ifstream in(argv[2], std::ios::binary);
    if (!in) {
        std::fprintf(stderr, "error: cannot read %s\n", argv[2]);
        return 1;
    }
    std::ostringstream out;
    std::string line;
    size_t cases = 0;
    while (std::getline(in, line)) {
        char * end = nullptr;
        const unsigned long long len = std::strtoull(line.c_str(), &end, 10);
        if (line.empty() || *end != '\0') {
            std::fprintf(stderr, "error: %s: case %zu: expected a byte length, got '%s'\n", argv[2], cases, line.c_str());
            return 1;
        }
        std::string text(len, '\0');
        in.read(text.data(), (std::streamsize) len);
        if ((unsigned long long) in.gcount() != len || in.get() != '\n') {
            std::fprintf(stderr, "error: %s: case %zu is truncated\n", argv[2], cases);
            return 1;
        }
        for (bool parse_special : {false, true}) {
            const auto ids = tokenize(vocab, text, parse_special);
            for (size_t i = 0; i < ids.size(); i++) {
                out << (i ? " " : "") << ids[i];
            }
            out << "\n";
        }
        cases++;
    }
    std::ofstream o(argv[3], std::ios::binary);
    o << out.str();
    if (!o.good()) {
        std::fprintf(stderr, "error: cannot write %s\n", argv[3]);
        return 1;
    }
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
