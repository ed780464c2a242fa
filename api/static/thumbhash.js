// Decodes a ThumbHash (the base64 string a job's `thumbhash` holds) into a small blurred picture,
// which the progress page's grid shows while the thumbnail itself loads. The format's published
// algorithm, the inverse of worker/thumbnails/render/output.py's encoder: a DC colour and a few cosine terms
// of luminance, two opponent-colour channels and (if any) alpha.
"use strict";

(function (root) {
  function readHash(text) {
    const raw = atob(String(text));
    const bytes = new Uint8Array(raw.length);
    for (let i = 0; i < raw.length; i++) bytes[i] = raw.charCodeAt(i);
    if (bytes.length < 5) throw new Error("thumbhash too short");
    return bytes;
  }

  // Width / height of the picture the hash was made from (to a few percent).
  function aspect(hash) {
    const header = hash[3];
    const hasAlpha = hash[2] & 0x80;
    const landscape = hash[4] & 0x80;
    const lx = landscape ? (hasAlpha ? 5 : 7) : header & 7;
    const ly = landscape ? header & 7 : hasAlpha ? 5 : 7;
    return lx / ly;
  }

  // {w, h, rgba}: at most 32 px on the longer side.
  function toRGBA(text) {
    const hash = readHash(text);
    const header24 = hash[0] | (hash[1] << 8) | (hash[2] << 16);
    const header16 = hash[3] | (hash[4] << 8);
    const lDc = (header24 & 63) / 63;
    const pDc = ((header24 >> 6) & 63) / 31.5 - 1;
    const qDc = ((header24 >> 12) & 63) / 31.5 - 1;
    const lScale = ((header24 >> 18) & 31) / 31;
    const hasAlpha = header24 >> 23;
    const pScale = ((header16 >> 3) & 63) / 63;
    const qScale = ((header16 >> 9) & 63) / 63;
    const landscape = header16 >> 15;
    const lx = Math.max(3, landscape ? (hasAlpha ? 5 : 7) : header16 & 7);
    const ly = Math.max(3, landscape ? header16 & 7 : hasAlpha ? 5 : 7);
    const aDc = hasAlpha ? (hash[5] & 15) / 15 : 1;
    const aScale = (hash[5] >> 4) / 15;

    let index = 0;
    const start = hasAlpha ? 6 : 5;
    function channel(nx, ny, scale) {
      const ac = [];
      for (let cy = 0; cy < ny; cy++) {
        for (let cx = cy ? 0 : 1; cx * ny < nx * (ny - cy); cx++) {
          const nibble = (hash[start + (index >> 1)] >> ((index & 1) << 2)) & 15;
          ac.push((nibble / 7.5 - 1) * scale);
          index++;
        }
      }
      return ac;
    }
    const lAc = channel(lx, ly, lScale);
    // Chroma is boosted a little: quantisation washes it out.
    const pAc = channel(3, 3, pScale * 1.25);
    const qAc = channel(3, 3, qScale * 1.25);
    const aAc = hasAlpha ? channel(5, 5, aScale) : [];

    const ratio = aspect(hash);
    const w = Math.round(ratio > 1 ? 32 : 32 * ratio);
    const h = Math.round(ratio > 1 ? 32 / ratio : 32);
    const rgba = new Uint8ClampedArray(w * h * 4);
    const fx = [];
    const fy = [];
    for (let y = 0, i = 0; y < h; y++) {
      for (let x = 0; x < w; x++, i += 4) {
        let l = lDc;
        let p = pDc;
        let q = qDc;
        let a = aDc;
        for (let cx = 0, n = Math.max(lx, hasAlpha ? 5 : 3); cx < n; cx++) {
          fx[cx] = Math.cos((Math.PI / w) * (x + 0.5) * cx);
        }
        for (let cy = 0, n = Math.max(ly, hasAlpha ? 5 : 3); cy < n; cy++) {
          fy[cy] = Math.cos((Math.PI / h) * (y + 0.5) * cy);
        }
        for (let cy = 0, j = 0; cy < ly; cy++) {
          for (let cx = cy ? 0 : 1, fy2 = fy[cy] * 2; cx * ly < lx * (ly - cy); cx++, j++) {
            l += lAc[j] * fx[cx] * fy2;
          }
        }
        for (let cy = 0, j = 0; cy < 3; cy++) {
          for (let cx = cy ? 0 : 1, fy2 = fy[cy] * 2; cx < 3 - cy; cx++, j++) {
            const f = fx[cx] * fy2;
            p += pAc[j] * f;
            q += qAc[j] * f;
          }
        }
        if (hasAlpha) {
          for (let cy = 0, j = 0; cy < 5; cy++) {
            for (let cx = cy ? 0 : 1, fy2 = fy[cy] * 2; cx < 5 - cy; cx++, j++) {
              a += aAc[j] * fx[cx] * fy2;
            }
          }
        }
        const b = l - (2 / 3) * p;
        const r = (3 * l - b + q) / 2;
        const g = r - q;
        rgba[i] = 255 * Math.min(1, Math.max(0, r));
        rgba[i + 1] = 255 * Math.min(1, Math.max(0, g));
        rgba[i + 2] = 255 * Math.min(1, Math.max(0, b));
        rgba[i + 3] = 255 * Math.min(1, Math.max(0, a));
      }
    }
    return { w, h, rgba };
  }

  // A <canvas> holding the decoded picture (the browser's scaling blurs it further), or null.
  function canvas(text) {
    let picture;
    try {
      picture = toRGBA(text);
    } catch (err) {
      return null;
    }
    const el = document.createElement("canvas");
    el.width = picture.w;
    el.height = picture.h;
    el.getContext("2d").putImageData(new ImageData(picture.rgba, picture.w, picture.h), 0, 0);
    return el;
  }

  root.thumbhash = { toRGBA, canvas, aspect };
})(window);
