// CPU decode attention on the compressed cache (q_len 1..16 causal, GQA, softcap, batches).
//
// Thread -> data mapping. Work item = (sequence, kv head, piece): piece 0 holds the fp16 tokens
// (sink + window, unrotated query), pieces 1..n are fixed chunks of compressed tokens (chunk size
// depends only on the sequence length, never on the thread count). An item runs every query vector
// of its kv head (query rows x GQA group heads, in tiles of Kernels::max_tile: 8 or 4) over its tokens, so each page
// is read once per tile and stays in cache for the next tile. Each (item, query vector) owns an
// online-softmax state (m, l, acc); the merge (parallel over query vectors) combines pieces in
// index order, un-permutes and un-rotates the compressed accumulator once (float32 FWHT), and
// divides by the softmax sum. Results are bit-identical for any thread count.
// Format 3 (3-bit sections in tile blocks, tile.h): the rotated query is put in the K scratch's
// coordinate order once (tile_k_query_order), the kernels use the signed tables of the section's
// codebook, and the merge un-permutes a tiled V accumulator with tile_v_unpermute.
#include <cmath>
#include <cstdlib>
#include <memory>
#include <vector>

#include "backend.h"
#include "../format/codebook.h"
#include "../format/rotation.h"
#include "../core/tensor_io.h"
#include "kernels.h"
#include "quantize.h"
#include "thread_pool.h"
#include "tile.h"

namespace fmkv::cpu {
namespace {

// Software prefetch distance in tokens: FMKV_CPU_PREFETCH (multiple of 16, 0 = off), default 128.
int64_t prefetch_distance() {
  static const int64_t v = [] {
    const char* e = std::getenv("FMKV_CPU_PREFETCH");
    int64_t x = e ? std::atoll(e) : 128;
    return x < 0 ? 0 : (x / 16) * 16;
  }();
  return v;
}

struct SeqHead {
  int32_t seq, h;
  int64_t nvec;       // query vectors of this kv head (rows x group)
  int64_t pieces;     // 1 + number of compressed chunks
  int64_t chunk;      // compressed tokens per chunk
  int64_t state0;     // first state index of this (seq, head): [piece][vector]
};

}  // namespace

void decode_attention(const AttentionArgs& a) {
  const fmkv_config& c = a.cfg;
  const Kernels& K = kernels();
  const int32_t d = c.head_dim, H = c.num_kv_heads, HQ = a.q.heads, group = HQ / H, S = c.sink_tokens;
  const float scale = a.opts.softmax_scale > 0 ? a.opts.softmax_scale : (float)(1.0 / std::sqrt((double)d));
  const int64_t rows = a.q.rows;
  if (rows == 0) return;
  uint64_t sw[4] = {0, 0, 0, 0};
  rotation_sign_words(c.seed, a.layer.layer, d, sw);
  ThreadPool& pool = ThreadPool::instance();
  const int32_t version = fmkv_resolved_format_version(c.format_version);
  const bool k_tiled = fmkv_tiled_codes(version, c.k_bits), v_tiled = fmkv_tiled_codes(version, c.v_bits);

  // Scaled queries, raw (fp16 keys) and rotated (compressed keys): [row][hq][d].
  std::unique_ptr<float[]> qraw(new float[(size_t)rows * HQ * d]), qrot(new float[(size_t)rows * HQ * d]);
  auto rotate_row = [&](int64_t row) {
    float x[256];
    for (int32_t hq = 0; hq < HQ; ++hq) {
      float* qs = &qraw[((size_t)row * HQ + hq) * d];
      for (int32_t i = 0; i < d; ++i) qs[i] = load_f32(a.q, row, hq, i) * scale;
      for (int32_t i = 0; i < d; ++i) x[i] = qs[i];
      float* qr = &qrot[((size_t)row * HQ + hq) * d];
      if (k_tiled) {
        float y[256];
        rotate(x, d, sw, y);
        tile_k_query_order(y, d, qr);
      } else {
        rotate(x, d, sw, qr);
      }
    }
  };
  if (rows * HQ <= 64) {  // a pool round trip costs more than this
    for (int64_t row = 0; row < rows; ++row) rotate_row(row);
  } else {
    pool.parallel_for(rows, rotate_row);
  }

  // Work list.
  std::vector<SeqHead> sh;
  std::vector<std::pair<int32_t, int64_t>> items;  // (seq-head index, piece)
  int64_t nstates = 0;
  for (int32_t s = 0; s < a.batch.num_seqs; ++s) {
    const int64_t nq = a.batch.row_offsets[s + 1] - a.batch.row_offsets[s], len = a.batch.seq_lens[s];
    if (nq == 0) continue;
    const int64_t ncomp = compressed_end(c, len) - S;
    const int64_t chunk = ncomp <= 16384 ? 512 : 1024;
    const int64_t pieces = 1 + (ncomp + chunk - 1) / chunk;
    for (int32_t h = 0; h < H; ++h) {
      for (int64_t p = 0; p < pieces; ++p) items.push_back({(int32_t)sh.size(), p});
      sh.push_back({s, h, nq * group, pieces, chunk, nstates});
      nstates += pieces * nq * group;
    }
  }
  const int64_t stride = d + 2;  // per state: m, l, acc[d]
  std::unique_ptr<float[]> states(new float[(size_t)(nstates * stride)]);

  pool.parallel_for((int64_t)items.size(), [&](int64_t it) {
    const SeqHead& x = sh[(size_t)items[(size_t)it].first];
    const int64_t piece = items[(size_t)it].second;
    const int64_t row0 = a.batch.row_offsets[x.seq], nq = a.batch.row_offsets[x.seq + 1] - row0;
    const int64_t len = a.batch.seq_lens[x.seq], E = compressed_end(c, len);
    AttnJob job;
    std::vector<const uint16_t*> fk, fv;  // piece 0: the fp16 tokens [0, min(S, len)) and [E, len)
    std::vector<int64_t> fpos;
    if (piece == 0 && fp16_slots(c) > 0) {
      const int32_t slot = a.batch.slots ? a.batch.slots[x.seq] : 0, RS = fp16_slots(c);
      const uint16_t* kr = a.layer.fp16_k + ((int64_t)slot * H + x.h) * RS * d;
      const uint16_t* vr = a.layer.fp16_v + ((int64_t)slot * H + x.h) * RS * d;
      for (int64_t p = 0; p < len; ++p) {
        if (p == (S < len ? S : len)) p = E;
        if (p >= len) break;
        fk.push_back(kr + (int64_t)fp16_slot_of(c, p) * d);
        fv.push_back(vr + (int64_t)fp16_slot_of(c, p) * d);
        fpos.push_back(p);
      }
    }
    if (piece > 0) {
      job.pages = a.layer.pages;
      job.page_bytes = page_bytes(c);
      job.k_off = section_offset(c, x.h, 0);
      job.v_off = section_offset(c, x.h, 1);
      job.block_table = a.batch.block_table + (int64_t)x.seq * a.batch.block_table_stride;
      job.P = c.page_size;
      job.d = d;
      job.k_bits = c.k_bits;
      job.v_bits = c.v_bits;
      job.k_tiled = k_tiled;
      job.v_tiled = v_tiled;
      job.ssh = fmkv_scale_shift(c.scale_group);
      job.softcap = a.opts.softcap;
      job.prefetch_tokens = prefetch_distance();
      if (k_tiled) {
        signed_table16(codebook_table(version, c.k_bits, 0), job.tk);
        signed_int_table16(codebook_table(version, c.k_bits, 0), job.tk_int, &job.tk_step);
      } else if (c.k_bits != FMKV_FP16_BITS) codebook_table16(c.k_bits, codebook_table(version, c.k_bits, 0), job.tk);
      if (v_tiled) signed_table16(codebook_table(version, c.v_bits, 1), job.tv);
      else codebook_table16(c.v_bits, codebook_table(version, c.v_bits, 1), job.tv);
      if (c.k_bits == 4) signed_table16_4bit(codebook_table(version, 4, 0), job.tk4);
      if (c.v_bits == 4) signed_table16_4bit(codebook_table(version, 4, 1), job.tv4);
    }
    for (int64_t v0 = 0; v0 < x.nvec; v0 += K.max_tile) {
      const int R = (int)(x.nvec - v0 < K.max_tile ? x.nvec - v0 : K.max_tile);
      AttnState st[kMaxTile];
      const float* q[kMaxTile];
      int64_t pos[kMaxTile], climit[kMaxTile], cmax = 0;
      for (int r = 0; r < R; ++r) {
        const int64_t v = v0 + r, j = v / group, hq = (int64_t)x.h * group + v % group;
        float* sp = &states[(size_t)((x.state0 + piece * x.nvec + v) * stride)];
        st[r] = {-INFINITY, 0.0f, sp + 2};
        for (int32_t i = 0; i < d; ++i) st[r].acc[i] = 0.0f;
        pos[r] = len - nq + j;
        const bool kraw = piece == 0 || c.k_bits == FMKV_FP16_BITS;
        q[r] = &(kraw ? qraw : qrot)[((size_t)(row0 + j) * HQ + hq) * d];
        const int64_t lim = (pos[r] + 1 < E ? pos[r] + 1 : E) - S;
        climit[r] = lim;
        cmax = lim > cmax ? lim : cmax;
      }
      if (piece == 0) {
        K.attend_fp16(d, (int64_t)fk.size(), fk.data(), fv.data(), fpos.data(), R, q, pos, a.opts.softcap, st);
      } else {
        job.c0 = (piece - 1) * x.chunk;
        job.c1 = job.c0 + x.chunk < cmax ? job.c0 + x.chunk : cmax;
        if (job.c1 > job.c0) K.attend(job, R, q, climit, st);
      }
      for (int r = 0; r < R; ++r) {
        float* sp = &states[(size_t)((x.state0 + piece * x.nvec + v0 + r) * stride)];
        sp[0] = st[r].m;
        sp[1] = st[r].l;
      }
    }
  });

  // Merge pieces in order, un-rotate once, write out.
  std::vector<std::pair<int32_t, int64_t>> vecs;  // (seq-head index, vector)
  for (size_t i = 0; i < sh.size(); ++i)
    for (int64_t v = 0; v < sh[i].nvec; ++v) vecs.push_back({(int32_t)i, v});
  auto merge = [&](int64_t vi) {
    const SeqHead& x = sh[(size_t)vecs[(size_t)vi].first];
    const int64_t v = vecs[(size_t)vi].second;
    const int64_t row = a.batch.row_offsets[x.seq] + v / group;
    const int32_t hq = x.h * group + (int32_t)(v % group);
    float M = -INFINITY;
    for (int64_t p = 0; p < x.pieces; ++p) {
      const float m = states[(size_t)((x.state0 + p * x.nvec + v) * stride)];
      M = m > M ? m : M;
    }
    float L = 0.0f, raw[256], rot[256], nat[256], y[256];
    for (int32_t i = 0; i < d; ++i) raw[i] = rot[i] = 0.0f;
    for (int64_t p = 0; p < x.pieces; ++p) {
      const float* sp = &states[(size_t)((x.state0 + p * x.nvec + v) * stride)];
      if (sp[0] == -INFINITY) continue;
      const float f = std::exp(sp[0] - M);
      L += sp[1] * f;
      float* acc = p == 0 ? raw : rot;
      for (int32_t i = 0; i < d; ++i) acc[i] += sp[2 + i] * f;
    }
    if (v_tiled) tile_v_unpermute(rot, d, nat);
    else K.unpermute(rot, d, nat);
    unrotate(nat, d, sw, y);
    const float inv = 1.0f / L;
    for (int32_t i = 0; i < d; ++i) store_f32(a.out, row, hq, i, (raw[i] + y[i]) * inv);
    if (a.lse.data) store_f32(a.lse, row, hq, 0, M + std::log(L));
  };
  if (nstates * d < (1 << 18)) {  // small merge: not worth a pool round trip
    for (int64_t vi = 0; vi < (int64_t)vecs.size(); ++vi) merge(vi);
  } else {
    pool.parallel_for((int64_t)vecs.size(), merge);
  }
}

}  // namespace fmkv::cpu
