// Builds the dashboard into static files (index.html, assets/*.js, *.css) that
// `dvr serve` serves at /. The output directory is DVR_WEB_OUT (set by CMake's
// dvr-web target to ${build}/web, where `dvr serve` looks by default), else dist/.
// Nothing is fetched at run time: no CDN, no web fonts (system fonts only).
import { defineConfig } from 'vite';

export default defineConfig({
  base: './',
  build: {
    outDir: process.env.DVR_WEB_OUT || 'dist',
    emptyOutDir: true,
    target: 'es2020',
    sourcemap: false,
    reportCompressedSize: false,
    chunkSizeWarningLimit: 200,
  },
  server: {
    // `npm run dev` against a running `dvr serve` (DVR_SERVE_URL, default the default listen address)
    proxy: { '/api': process.env.DVR_SERVE_URL || 'http://127.0.0.1:8642' },
  },
});
