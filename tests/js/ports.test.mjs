import { test } from 'node:test'
import assert from 'node:assert/strict'
import { sandbox, waitFor } from './helpers.mjs'

// The gateway serves plain HTTP on loopback: a sandbox's port is reached by
// its host name, `{port}-{id}.{domain}`, through the gateway's address.
async function viaGateway(host, path = '/') {
  const gateway = new URL(process.env.E2B_SANDBOX_URL)
  const { request } = await import('node:http')
  return await new Promise((resolve, reject) => {
    const req = request({ host: gateway.hostname, port: gateway.port, path, headers: { host } }, (res) => {
      let body = ''
      res.on('data', (c) => { body += c })
      res.on('end', () => resolve({ status: res.statusCode, body }))
    })
    req.on('error', reject)
    req.end()
  })
}

test('a server in the sandbox answers by host name', async () => {
  const sbx = await sandbox()
  await sbx.files.write('/home/user/www/index.html', 'served from the sandbox')
  await sbx.commands.run('cd /home/user/www && python3 -m http.server 8000', { background: true })
  const host = sbx.getHost(8000)
  assert.equal(host, `8000-${sbx.sandboxId}.${sbx.sandboxDomain}`)
  const answer = await waitFor('the server', async () => {
    const r = await viaGateway(host, '/index.html')
    return r.status === 200 && r
  })
  assert.equal(answer.body, 'served from the sandbox')
})
